"""`kvshuttle` command line: one subcommand per process kind, plus the local stack and its demo."""

from __future__ import annotations

import faulthandler
import importlib
import importlib.util
import signal
import sys
from collections.abc import Sequence

from kvshuttle.services.commands.installs import DEV, install_of, missing

PKG = "kvshuttle.services"

# subcommand -> (module with main(argv), one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": (f"{DEV}.stack", "Start the whole local stack, run a 4-turn conversation, print the table, stop"),
    "up": (f"{DEV}.stack", "Start the whole local stack and keep it running until Ctrl-C"),
    "bench": (f"{DEV}.bench.multiturn", "Multi-turn benchmark: TTFT with pull vs recompute vs ideal, and the control "
              "plane's own overhead (starts the local stack)"),
    "registry": (f"{PKG}.registry.server", "Run the session registry (gRPC, etcd-backed)"),
    "scheduler": (f"{PKG}.scheduler.server", "Run the transfer scheduler (gRPC)"),
    "gateway": (f"{PKG}.commands.gateway", "Run the gateway (OpenAI HTTP API, REST bridge, gRPC)"),
    "worker": ("kvshuttle.workers.agent", "Run a vLLM prefill or decode worker and register it"),
    "hash-key": (f"{PKG}.gateway.edge.auth", "Print the gateway's API-keys-file entry for a key (read on stdin) or a "
                 "new one"),
    "make-model": ("kvshuttle.workers.model_builder", "Build the small offline test model into a directory"),
    "bench-services": (f"{DEV}.bench.services_bench", "Microbenchmarks of the registry and scheduler (no vLLM)"),
    "bench-gateway": (f"{DEV}.bench.gateway_capacity", "The gateway's own streaming capacity: tokens/s per gateway core "
                      "and streams held under a p99 inter-token bound, against fake engines (no vLLM)"),
    "bench-agent": (f"{DEV}.bench.agent_overhead", "What tools and reasoning add to each turn in the gateway: "
                    "template rendering, tokenizing, session keys, answer parsing (no vLLM)"),
    "bench-clients": (f"{DEV}.bench.client_styles", "How much of each later turn's history is pulled, per client style "
                      "(echo whole, reasoning dropped, Qwen3's template; with and without a session id), on the "
                      "reasoning agent test model (starts the local stack)"),
    "soak": (f"{DEV}.bench.soak", "Many concurrent sessions through the gateway for minutes: failed turns (must be 0), "
             "turns/s and the services' memory over time (starts the local stack)"),
    "bench-eviction": (f"{DEV}.bench.eviction_sim", "Decode-KV eviction policies compared in a simulation (the real "
                       "choice code, no vLLM): value vs LRU"),
    "simulate": (f"{DEV}.simulator.main", "A simulated P/D cluster (up to thousands of workers) running the real planner "
                 "and KV policies: kvshuttle vs vLLM's threshold rule, always recompute and a cache-aware router"),
    "bench-kv-feed": (f"{DEV}.bench.kv_feed_load", "What following the KV feed (every prefill worker's KV-cache "
                      "events) costs one planner replica, and Redis, for a synthetic fleet (no vLLM)"),
    "bench-policies": (f"{DEV}.bench.policy_sweep", "Pull-vs-recompute policies compared: the cost model vs fixed "
                       "thresholds, TTFT by history length"),
    "smoke-test": (f"{PKG}.commands.smoke_test", "A short conversation through a running gateway (the Helm chart's "
                   "`helm test`): every turn answers, the later ones report their KV decision"),
    "health-check": (f"{PKG}.commands.health_check", "One grpc.health Check of a kvshuttle server, TLS included (exit "
                     "0 only when SERVING): for Kubernetes exec probes"),
    "traces": (f"{PKG}.commands.trace_view", "Receive OTLP/gRPC traces and print each turn's trace as a tree with "
               "timings (no tracing backend needed)"),
}


def usage() -> str:
    lines = ["usage: kvshuttle <command> [options]   (kvshuttle <command> --help for its options)", "", "commands:"]
    width = max(map(len, COMMANDS))
    lines += [f"  {name:<{width}} {text}" for name, (_, text) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Run a subcommand; returns its exit status (the commands that return one: worker, health-check, ...)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        print(f"kvshuttle: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        raise SystemExit(2)
    install = install_of(COMMANDS[name][0])
    lacking = missing(install)
    if lacking:  # e.g. make-model without torch: one line that says which install has it, not a traceback
        print(f"kvshuttle: {name} needs {install.name} ({', '.join(lacking)} not installed): {install.pip}",
              file=sys.stderr)
        return 2
    # ``kill -USR1 <pid>`` prints every thread's stack to the process's stderr (its log): where a stuck one waits.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        module = importlib.import_module(COMMANDS[name][0])
        if module.__name__ == f"{DEV}.stack":
            return module.main(rest, command=name) or 0
        return module.main(rest) or 0
    except ModuleNotFoundError as exc:
        if (exc.name or "").startswith(DEV):  # the control-plane image removes the development tools
            print(f"kvshuttle: {name} is not in this installation (it leaves out {DEV}); {name} runs from "
                  f"{install.pip}", file=sys.stderr)
            return 2
        top = (exc.name or "").partition(".")[0]
        if not top or top == "kvshuttle" or importlib.util.find_spec(top) is not None:
            raise
        print(f"kvshuttle: {name} needs the module {top!r}, which is not installed; {name} runs from "
              f"{install.pip}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
