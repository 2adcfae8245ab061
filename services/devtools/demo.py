"""The demo conversation, through the gateway's OpenAI API, streamed: one of two.

- ``agent`` (the random test models): a coding agent reading stdlib files turn by turn; the answers are random bytes.
- ``geography`` (a real model: ``--model-variant smollm2``): a user pastes their notes on one region's countries each
  turn (capital, language, currency) and asks one question about them; a real instruct model answers in a sentence.

Each turn is also replayed with pulls disabled (a twin session) so the table shows TTFT for pull and recompute side
by side, and whether the greedy answers are identical; the answers are printed after it.
"""

from __future__ import annotations

import inspect
import uuid
from dataclasses import dataclass

import httpx
from kvshuttle.services.devtools.chat_stream import stream_chat
from kvshuttle.services.engine.client import EngineClient
from kvshuttle.v1 import common_pb2

SYSTEM = ("You are a coding agent. You read source files with tools and explain what they do, "
          "citing function names. Keep answers short.")
# Tool results the agent "reads": stdlib sources, identical on every machine with the same Python.
FILES = ["textwrap", "json.decoder", "string", "bisect", "heapq", "fnmatch", "colorsys", "shlex"]


def tool_result(module: str, chars: int = 2400) -> str:
    mod = __import__(module, fromlist=["_"])
    return inspect.getsource(mod)[:chars]


GEOGRAPHY_SYSTEM = "You are a helpful geography tutor. Answer in one short sentence."
# The user's notes, one region a turn (about 400 tokens each): country | capital | language(s) | currency.
COUNTRIES = {
    "Europe": """
France | Paris | French | euro
Germany | Berlin | German | euro
Italy | Rome | Italian | euro
Spain | Madrid | Spanish | euro
Portugal | Lisbon | Portuguese | euro
the Netherlands | Amsterdam | Dutch | euro
Poland | Warsaw | Polish | złoty
Sweden | Stockholm | Swedish | Swedish krona
Norway | Oslo | Norwegian | Norwegian krone
Greece | Athens | Greek | euro
Austria | Vienna | German | euro
Ireland | Dublin | Irish and English | euro
Switzerland | Bern | German, French, Italian and Romansh | Swiss franc
Hungary | Budapest | Hungarian | forint
Czechia | Prague | Czech | Czech koruna""",
    "Asia": """
Japan | Tokyo | Japanese | yen
China | Beijing | Mandarin Chinese | renminbi
India | New Delhi | Hindi and English | Indian rupee
South Korea | Seoul | Korean | won
Thailand | Bangkok | Thai | baht
Vietnam | Hanoi | Vietnamese | đồng
Bangladesh | Dhaka | Bengali | taka
the Philippines | Manila | Filipino and English | Philippine peso
Turkey | Ankara | Turkish | Turkish lira
Iran | Tehran | Persian | Iranian rial
Saudi Arabia | Riyadh | Arabic | Saudi riyal
Pakistan | Islamabad | Urdu and English | Pakistani rupee
Malaysia | Kuala Lumpur | Malay | ringgit
Nepal | Kathmandu | Nepali | Nepalese rupee
Mongolia | Ulaanbaatar | Mongolian | tögrög""",
    "the Americas": """
the United States | Washington, D.C. | English | US dollar
Canada | Ottawa | English and French | Canadian dollar
Mexico | Mexico City | Spanish | Mexican peso
Brazil | Brasília | Portuguese | Brazilian real
Argentina | Buenos Aires | Spanish | Argentine peso
Chile | Santiago | Spanish | Chilean peso
Peru | Lima | Spanish | sol
Colombia | Bogotá | Spanish | Colombian peso
Cuba | Havana | Spanish | Cuban peso
Venezuela | Caracas | Spanish | bolívar
Ecuador | Quito | Spanish | US dollar
Uruguay | Montevideo | Spanish | Uruguayan peso
Jamaica | Kingston | English | Jamaican dollar
Costa Rica | San José | Spanish | colón
Paraguay | Asunción | Spanish and Guarani | guaraní""",
    "Africa": """
Egypt | Cairo | Arabic | Egyptian pound
Nigeria | Abuja | English | naira
Kenya | Nairobi | Swahili and English | Kenyan shilling
Morocco | Rabat | Arabic and Berber | Moroccan dirham
Ghana | Accra | English | cedi
Senegal | Dakar | French | CFA franc
Tanzania | Dodoma | Swahili and English | Tanzanian shilling
Algeria | Algiers | Arabic and Berber | Algerian dinar
Tunisia | Tunis | Arabic | Tunisian dinar
Uganda | Kampala | English and Swahili | Ugandan shilling
Angola | Luanda | Portuguese | kwanza
Madagascar | Antananarivo | Malagasy and French | ariary
Zambia | Lusaka | English | kwacha
Namibia | Windhoek | English | Namibian dollar
Botswana | Gaborone | English | pula""",
}
# One question a turn, about that turn's region: answers a small instruct model gets right.
QUESTIONS = (("Europe", "What is the capital of France?"), ("Asia", "What is the capital of Japan?"),
             ("the Americas", "Which language is spoken in Brazil?"), ("Africa", "What is the capital of Kenya?"))


def country_notes(region: str) -> str:
    lines = []
    for row in COUNTRIES[region].strip().splitlines():
        country, capital, language, currency = row.split(" | ")
        languages = "languages are" if " and " in language else "language is"
        lines.append(f"- {country}: the capital is {capital}; the {languages} {language}; the currency is the "
                     f"{currency}.")
    return "\n".join(lines)


def geography_turn(turn: int) -> tuple[str, str]:
    """Turn ``turn``'s user message (a region's notes and a question; regions repeat after four turns) and the
    question alone."""
    region, question = QUESTIONS[turn % len(QUESTIONS)]
    return f"My notes on {region}:\n{country_notes(region)}\n\n{question}", question


def agent_turn(turn: int) -> tuple[str, str]:
    """Turn ``turn``'s user message (a stdlib file as a tool result) and its question."""
    module = FILES[turn % len(FILES)]
    return f"Tool result of `cat {module}.py`:\n{tool_result(module)}\nWhat does it do?", f"What does {module} do?"


CONVERSATIONS = {"agent": (SYSTEM, agent_turn), "geography": (GEOGRAPHY_SYSTEM, geography_turn)}


@dataclass
class TurnResult:
    decision: str
    reason: str
    prompt_tokens: int
    pulled: int
    computed: int
    ttft_ms: float
    text: str


async def stream_turn(client: httpx.AsyncClient, session: str, messages: list[dict], max_tokens: int,
                      disable_pull: bool) -> TurnResult:
    got = await stream_chat(client, session, {"messages": messages, "max_tokens": max_tokens, "temperature": 0,
                                              "disable_pull": disable_pull})
    return TurnResult(got.kv["decision"], got.kv["reason"], got.usage.get("prompt_tokens", 0),
                      got.kv["pulled_tokens"], got.kv["computed_tokens"], got.ttft_ms, got.text)


async def flush_prefill_caches(workers: list[common_pb2.Worker]) -> None:
    for w in workers:
        if w.role == common_pb2.WORKER_ROLE_PREFILL:
            client = EngineClient(w.grpc_address, timeout_s=30)
            try:
                await client.flush_cache()
            finally:
                await client.close()


async def run_demo(stack, cfg) -> int:
    session = f"demo-{uuid.uuid4().hex[:8]}"
    twin = f"{session}-recompute"
    kind = cfg.conversation_kind
    system, make_turn = CONVERSATIONS[kind]
    history: list[dict] = [{"role": "system", "content": system}]
    twin_history = list(history)
    rows = []
    questions = []
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=600) as client:
        for turn in range(cfg.turns):
            content, question = make_turn(turn)
            questions.append(question)
            user = {"role": "user", "content": content}
            history.append(user)
            if cfg.flush_prefill_cache:
                await flush_prefill_caches(stack.workers)
            pull = await stream_turn(client, session, history, cfg.max_tokens, disable_pull=False)
            history.append({"role": "assistant", "content": pull.text})
            base = None
            if cfg.compare_recompute:
                twin_history.append(user)
                if cfg.flush_prefill_cache:
                    await flush_prefill_caches(stack.workers)
                base = await stream_turn(client, twin, twin_history, cfg.max_tokens, disable_pull=True)
                twin_history.append({"role": "assistant", "content": base.text})
            rows.append((turn + 1, pull, base))

    print()
    print(f"kvshuttle demo: {cfg.turns}-turn {kind} conversation {session!r} through the gateway at {stack.base_url}")
    print(f"model {stack.model_dir.name} ({cfg.dtype}), P's prefix cache flushed before each turn: "
          f"{cfg.flush_prefill_cache}, scheduler policy: {cfg.policy}")
    header = f"{'turn':>4}  {'prompt':>6}  {'decision':<9}  {'pulled':>6}  {'computed':>8}  {'TTFT ms':>8}"
    if cfg.compare_recompute:
        header += f"  {'recompute TTFT ms':>17}  {'speed-up':>8}  {'same answer':>11}"
    print(header)
    print("-" * len(header))
    for n, pull, base in rows:
        line = (f"{n:>4}  {pull.prompt_tokens:>6}  {pull.decision:<9}  {pull.pulled:>6}  {pull.computed:>8}  "
                f"{pull.ttft_ms:>8.1f}")
        if base is not None:
            line += f"  {base.ttft_ms:>17.1f}  {base.ttft_ms / pull.ttft_ms:>7.2f}x  {str(base.text == pull.text):>11}"
        print(line)
    print()
    for n, pull, _ in rows:
        print(f"turn {n}: {pull.reason}")
    print()
    print("answers:" if kind == "geography" else "answers (a random test model's: tokens, not language):")
    for (n, pull, _), question in zip(rows, questions, strict=True):
        print(f"turn {n}: {question}\n    {answer_line(pull.text)}")
    ok = all(pull.decision == "pull" for _, pull, _ in rows[1:])
    same = all(base is None or base.text == pull.text for _, pull, base in rows)
    print()
    await print_metrics(stack)
    print()
    print("every turn after the first pulled its history: " + ("yes" if ok else "NO"))
    if cfg.compare_recompute:
        print("answers identical with and without pulls: " + ("yes" if same else "NO"))
    return 0 if ok and same else 1


def answer_line(text: str, limit: int = 200) -> str:
    """An answer on one line, at most ``limit`` characters."""
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[:limit - 3] + "..."


async def print_metrics(stack) -> None:
    """What the gateway's Prometheus endpoint says about the run (the warm-up and the recompute twin included)."""
    from prometheus_client.parser import text_string_to_metric_families

    url = stack.metrics["gateway"]
    try:
        async with httpx.AsyncClient(timeout=10) as client:
            text = (await client.get(url)).text
    except httpx.HTTPError as exc:
        print(f"metrics: {url} did not answer ({exc!r})")
        return
    turns: dict[str, float] = {}
    tokens: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "kvshuttle_turns_total":
                turns[sample.labels["decision"]] = turns.get(sample.labels["decision"], 0) + sample.value
            elif sample.name == "kvshuttle_turn_tokens_total":
                tokens[sample.labels["kind"]] = sample.value
    prompt = tokens.get("prompt", 0) or 1
    # pull and recompute always; a decision no turn took (e.g. local, continued on D) only when some did
    shown = {k: v for k, v in sorted(turns.items()) if v or k in ("pull", "recompute")}
    print(f"metrics ({url}): turns {', '.join(f'{k} {v:.0f}' for k, v in shown.items())}; prompt tokens "
          f"{tokens.get('prompt', 0):.0f} = pulled {tokens.get('pulled', 0):.0f} "
          f"({tokens.get('pulled', 0) / prompt:.0%}) + cached {tokens.get('cached', 0):.0f} + computed "
          f"{tokens.get('computed', 0):.0f}")
    print("other endpoints: " + ", ".join(f"{name} {u}" for name, u in stack.metrics.items() if name != "gateway"))
