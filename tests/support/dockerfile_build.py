"""A Dockerfile's build steps run in a directory instead of an image: what a change to the Dockerfile does to its
install, tested without a container engine.

The stage's instructions run in order, as ``docker build`` runs them, with the image's ``/`` mapped onto a directory
(``root``): ARG (as environment variables, build arguments over defaults), ENV, WORKDIR, COPY from the build context
(through ``.dockerignore``), RUN (``/bin/sh -c``, as Docker's shell form). Every absolute path in them is taken to be
inside the image and is mapped under ``root`` (``/dev/...`` excepted); ``python`` is this interpreter's base
Python (the image's ``python:3.11`` base), ``apt-get`` only checks that this machine has the packages the image
would install. pip sees this machine's pip configuration (``HOME``, ``PIP_*``) under the Dockerfile's own ENV.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from tests.support.clean_venv import SYSTEM_PATH, pip_env
from tests.support.dockerfile import DockerIgnore, Instruction, Stage, exec_form, substitute

# An absolute path in a shell line: a word (or the part after = < > |) starting with one slash.
_ABSOLUTE = re.compile(r"(?<![^\s'\"=<>(|;&`])/(?!/)[^\s'\"();|&<>`]*")
_APT_GET = """#!/bin/sh
# apt-get as a build run on this machine has it: `update` does nothing, `install` checks the packages are installed.
case "$1" in
  update) exit 0 ;;
  install) shift
    for p in "$@"; do
      case "$p" in -*) ;; *)
        dpkg-query -W -f='${Status}\\n' "$p" 2>/dev/null | grep -q "install ok installed" \\
          || { echo "apt-get install: $p is not installed on this machine" >&2; exit 1; } ;;
      esac
    done ;;
  *) echo "apt-get $1: not run outside an image" >&2; exit 1 ;;
esac
"""


# The directories a Debian-based image's `/` starts with (the base image's; a build may write to any of them).
BASE_DIRS = ("tmp", "opt", "srv", "root", "home", "etc", "var/lib", "var/tmp", "var/cache", "usr/local/bin")


class BuildStepFailed(AssertionError):
    pass


def map_paths(text: str, root: Path) -> str:
    """``text`` with each absolute path moved under ``root`` (``/dev/null`` and the like left alone)."""
    def repl(m: re.Match) -> str:
        path = m.group(0)
        return path if path.startswith("/dev/") else str(root) + path
    return _ABSOLUTE.sub(repl, text)


def _shims(where: Path) -> Path:
    where.mkdir(parents=True, exist_ok=True)
    (where / "python").write_text(f'#!/bin/sh\nexec {shlex.quote(sys._base_executable)} "$@"\n')
    (where / "apt-get").write_text(_APT_GET)
    for shim in where.iterdir():
        shim.chmod(0o755)
    return where


def _copy(sources: list[str], dest: Path, into: bool, context: Path, ignore: DockerIgnore) -> None:
    """Docker's COPY: a directory's contents into ``dest``; a file into ``dest`` (a directory when it ends in /)."""
    for src in sources:
        path = context / src
        if path.is_dir():
            for file in sorted(p for p in path.rglob("*") if p.is_file()):
                rel = file.relative_to(context).as_posix()
                if not ignore.excluded(rel):
                    target = dest / file.relative_to(path)
                    target.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(file, target)
        else:
            assert path.is_file() and not ignore.excluded(src), f"COPY {src}: not in the build context"
            target = dest / path.name if (into or dest.is_dir() or len(sources) > 1) else dest
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, target)


def build(stage: Stage, context: Path, root: Path, *, until: Callable[[Instruction], bool] = lambda i: False,
          build_args: dict[str, str] | None = None, timeout: float = 600) -> dict[str, str]:
    """Run ``stage``'s instructions up to and including the first one ``until`` accepts, with ``/`` at ``root``;
    returns the environment the last RUN had (its PATH finds the image's tools under ``root``). A failing RUN
    raises BuildStepFailed with the Dockerfile line and the command's output."""
    build_args = build_args or {}
    ignore = DockerIgnore.read(context / ".dockerignore")
    for folder in BASE_DIRS:
        (root / folder).mkdir(parents=True, exist_ok=True)
    env = pip_env(f"{_shims(root.parent / (root.name + '-shims'))}:{SYSTEM_PATH}")
    cwd = root
    for ins in stage.instructions:
        if ins.keyword == "ARG":
            for item in shlex.split(ins.args):
                name, eq, default = item.partition("=")
                value = build_args.get(name, default if eq else None)
                if value is not None:
                    env[name] = value
        elif ins.keyword == "ENV":
            items = shlex.split(ins.args)
            pairs = [i.partition("=")[::2] for i in items] if "=" in items[0] else [(items[0], " ".join(items[1:]))]
            for name, value in pairs:
                env[name] = substitute(":".join(map_paths(part, root) for part in value.split(":")), env)
        elif ins.keyword == "WORKDIR":
            path = substitute(ins.args, env)
            cwd = Path(map_paths(path, root)) if path.startswith("/") else cwd / path
            cwd.mkdir(parents=True, exist_ok=True)
        elif ins.keyword in ("COPY", "ADD"):
            rest = ins.args
            if re.search(r"--from[= ]", rest):
                continue
            rest = re.sub(r"^(--[\w-]+(=\S*)?\s+)+", "", rest)
            items = exec_form(rest) or shlex.split(rest)
            dest = items[-1]
            target = Path(map_paths(dest, root)) if dest.startswith("/") else cwd / dest
            _copy(items[:-1], target, dest.endswith("/"), context, ignore)
        elif ins.keyword == "RUN":
            argv = exec_form(ins.args)
            argv = [map_paths(a, root) for a in argv] if argv else ["/bin/sh", "-c", map_paths(ins.args, root)]
            done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
            if done.returncode != 0:
                raise BuildStepFailed(f"line {ins.line}: RUN {ins.args}\nexit {done.returncode}\n"
                                      f"{done.stdout[-3000:]}\n{done.stderr[-5000:]}")
        if until(ins):
            return env
    return env


def which(command: str, env: dict[str, str]) -> Path:
    found = shutil.which(command, path=env["PATH"])
    assert found, f"{command} is not on the build's PATH {env['PATH']}"
    return Path(found)

