"""The documentation's reference pages are generated from the code (docs/hooks/reference.py, an mkdocs hook): every
command's flags, every metric, span attribute and reason code is on them. tests/deploy/test_docs.py builds the site."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
from pathlib import Path

import pytest
from kvshuttle.control_plane import reasons
from kvshuttle.services.commands import cli
from kvshuttle.services.common import metrics
from kvshuttle.services.common.config import env_name, flag_name
from kvshuttle.services.common.span_attributes import SPAN_ATTRIBUTES

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def hook():
    spec = importlib.util.spec_from_file_location("docs_reference", ROOT / "docs/hooks/reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def config_page(hook) -> str:
    return hook.config_page()


def sections(page: str, level: str = "## ") -> dict[str, str]:
    parts = re.split(rf"^{level}(.+)$", page, flags=re.M)
    return {title.strip(): body for title, body in zip(parts[1::2], parts[2::2])}


def test_every_command_is_documented(hook):
    assert set(hook.CONFIGS) | set(hook.ARGPARSE) == set(cli.COMMANDS)
    assert not set(hook.CONFIGS) & set(hook.ARGPARSE)


def test_the_config_page_lists_every_flag_and_variable_of_every_command(hook, config_page):
    by_command = sections(config_page)
    shared = {re.search(r"\{#shared-([a-z-]+)\}", title).group(1): body
              for title, body in sections(by_command["Shared settings"], "### ").items()}
    assert set(shared) == {group for group, _, _ in hook.SHARED}
    for command, path in hook.CONFIGS.items():
        cls = hook._load(path)
        own = by_command[f"kvshuttle {command}"]
        for f in dataclasses.fields(cls):
            flag, env = f"`{flag_name(f)}`", f"`{env_name(cls, f)}`"
            rows = [line for line in own.splitlines() if line.startswith(f"| {flag}")]
            if not rows:  # a shared setting: listed once, linked from the command's section
                group = next(g for g, body in shared.items() if f"| {flag}" in body)
                assert f"(#shared-{group})" in own, (command, flag)
                rows = [line for line in shared[group].splitlines() if line.startswith(f"| {flag}")]
            assert len(rows) == 1 and env in rows[0], (command, flag, env)
            if f.metadata.get("help"):
                assert hook.cell(f.metadata["help"]) in rows[0], (command, flag)


def test_the_config_page_shows_each_commands_own_defaults(hook, config_page):
    bench = sections(config_page)["kvshuttle bench"]
    assert "| `--work-dir` | `KVSHUTTLE_BENCH_WORK_DIR` | str | `var/bench/stack` |" in bench
    assert "| `--kv-manage` / `--no-kv-manage` | `KVSHUTTLE_SCHEDULER_KV_MANAGE` | bool | `true` |" in sections(
        config_page)["kvshuttle scheduler"]


def test_the_argparse_commands_are_read_from_their_parsers(hook, config_page):
    by_command = sections(config_page)
    for command in hook.ARGPARSE:
        parser = hook.argparse_parser(command)
        options = [s for action in parser._actions for s in action.option_strings if s not in ("-h", "--help")]
        assert options, command
        assert all(f"`{option}`" in by_command[f"kvshuttle {command}"] for option in options), command
    assert "| `--tenant` | - | Tenant the key belongs to (required) |" in by_command["kvshuttle hash-key"]


def test_the_metrics_page_lists_every_catalogue_entry(hook):
    page = hook.metrics_page()
    for m in metrics.CATALOGUE:
        row = next(line for line in page.splitlines() if line.startswith(f"| `{m.name}` |"))
        assert f"| {m.type} |" in row and f"| {m.group} |" in row and hook.cell(m.help) in row, m.name
    assert "`claim_session`" in page and "`lease_keep_alive`" in page


def test_the_span_attribute_page_lists_the_catalogue(hook):
    page = hook.span_attributes_page()
    rows = [line for line in page.splitlines() if line.startswith("| `kvshuttle.")]
    assert [row.split("`")[1] for row in rows] == list(SPAN_ATTRIBUTES)


def test_every_reason_code_has_a_description(hook):
    assert set(reasons.DESCRIPTIONS) == reasons.VOCABULARY
    assert all(text.strip() for text in reasons.DESCRIPTIONS.values())
    page = hook.reasons_page()
    for code in reasons.VOCABULARY:
        assert f"| `{code}` |" in page, code


def test_included_files_exist(hook):
    for source in hook.INCLUDED.values():
        assert (ROOT / source).is_file(), source


def test_cells_escape_html_and_pipes_outside_code_spans(hook):
    assert hook.cell("`a|<b>` from <work dir> | a & b") == "`a|<b>` from &lt;work dir&gt; \\| a &amp; b"
