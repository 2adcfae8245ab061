"""One conversation turn through the disaggregated pair, as a chain of stages over one TurnContext: prompt → plan
→ prefill on P → decode on D → parse → record (runner.py says what each does).

Data flows one way: the request becomes exact prompt ids (continuing the session's recorded ids when the chat
extends them), the scheduler's plan says which workers and which kv_transfer_params, P's answer carries the params
for D, and D's final message carries the handle the registry records for the next turn.
"""

from kvshuttle.services.gateway.turns.context import Delta, Finished, KvOutcome, Tokenizer, TurnContext
from kvshuttle.services.gateway.turns.errors import TurnError, WorkerDown
from kvshuttle.services.gateway.turns.parsers import AnswerParsing
from kvshuttle.services.gateway.turns.request import TurnRequest
from kvshuttle.services.gateway.turns.runner import DEGRADED_KINDS, TurnRunner

__all__ = ["DEGRADED_KINDS", "AnswerParsing", "Delta", "Finished", "KvOutcome", "Tokenizer", "TurnContext", "TurnError",
           "TurnRequest", "TurnRunner", "WorkerDown"]
