"""Words that match (issue 24, item 5): the README, `--help` and what the program prints say the
same thing: `list`'s columns, which routes `--api-key` leaves open, the APIs `serve` offers, quant
modes as users write them (mixed:80MiB, never mixed-83886080), and piped chat's reply layout."""

from __future__ import annotations

import re
from pathlib import Path

from tests.cli_runner import run_tierlm
from tests.test_models_by_name import TINY, cache, ggufs, pinned_bandwidths  # noqa: F401
from tierlm.quant.modes import parse_quant_mode, quant_text
from tierlm.weights import embedded

README = Path(__file__).resolve().parents[1] / "README.md"


def flat(text: str) -> str:
    return " ".join(text.split())  # help and the README wrap lines anywhere


def test_the_readme_names_the_columns_list_prints(cache, ggufs):
    embedded.import_gguf_to_cache(ggufs["tiny"])
    listed = run_tierlm("list")
    assert listed.returncode == 0, listed.stderr
    header = listed.stdout.splitlines()[0].split()
    columns = re.search(r"tierlm list +# ([A-Z /]+), and a total", README.read_text()).group(1)
    assert columns.split() == header  # LAST USED is two words in both


def test_api_key_help_and_readme_name_every_route_it_leaves_open():
    from tierlm.server.app import _public

    open_paths = sorted({route.path for route in _public.routes})
    assert "/health" in open_paths and "/" in open_paths
    serve_help = flat(run_tierlm("serve", "--help", env={"COLUMNS": "200"}).stdout)
    api_key = serve_help.split("--api-key", 1)[1].split(" --", 1)[0]
    readme_bullet = flat(README.read_text().split("- `--api-key`", 1)[1].split("\n- ", 1)[0])
    for path in open_paths:
        named = "/health" if path == "/health" else "chat page at /"
        assert named in api_key or (path == "/" and "chat page" in api_key), (path, api_key)
        assert (f"`{path}`" in readme_bullet) or (path == "/" and "chat page" in readme_bullet), (path, readme_bullet)


def test_serve_names_both_apis_and_the_chat_page():
    listing = flat(run_tierlm("--help", env={"COLUMNS": "200"}).stdout)
    summary = listing.split(" serve ", 1)[1].split(".", 1)[0]
    assert "OpenAI" in summary and "Ollama" in summary and "chat page" in summary, summary
    description = flat(run_tierlm("serve", "--help", env={"COLUMNS": "200"}).stdout)
    assert "/api/chat" in description and "/v1/chat/completions" in description


def test_quant_modes_read_back_as_users_write_them():
    for written, stored in (("mixed:80MiB", "mixed-83886080"), ("mixed:5.2GiB", None), ("mixed:source", "mixed-source"),
                            ("int8-g128", "int8-g128"), ("int4-g32-asym", "int4-g32-asym")):  # fmt: skip
        name = parse_quant_mode(written).name
        assert stored is None or name == stored
        assert quant_text(name) == written
    assert quant_text("float16") == "float16"  # a dtype as stored is no mode: shown as it is


def test_an_artifact_is_listed_and_found_by_its_quant_as_written(cache, ggufs, pinned_bandwidths):
    embedded.import_gguf_to_cache(ggufs["tiny"])
    built = run_tierlm("convert", "--model", TINY, "--quant", "mixed:source")
    assert built.returncode == 0, built.stderr
    listed = run_tierlm("list").stdout
    assert "mixed:source" in listed and "mixed-source" not in listed, listed
    artifacts = run_tierlm("cache", "list").stdout
    assert f"{TINY}:mixed:source" in artifacts, artifacts
    # Both spellings, any case, name the one artifact; plan's quant line says it as written.
    shown = [run_tierlm("plan", spec, "--device", "cpu") for spec in
             (f"{TINY}:mixed:source", f"{TINY}:MIXED-SOURCE", f"{TINY}:mixed-source")]  # fmt: skip
    for done in shown:
        assert done.returncode == 0, done.stderr
        assert "mixed-source" not in done.stdout.split("\n", 1)[1], done.stdout  # line 1: the directory
    models = {done.stdout.splitlines()[0] for done in shown}
    assert len(models) == 1 and "artifacts" in models.pop()


def test_piped_chat_separates_replies_with_a_blank_line(cache, ggufs, pinned_bandwidths):
    embedded.import_gguf_to_cache(ggufs["tiny"])
    common = ["-t", "0", "-n", "4", "--quant", "int8"]
    one = run_tierlm("chat", TINY, *common, stdin="hello\n")
    two = run_tierlm("chat", TINY, *common, stdin="hello\nhello again\n")
    assert one.returncode == 0 and two.returncode == 0, two.stderr
    assert one.stdout.strip() and one.stdout.endswith("\n")
    # The first reply as a one-turn chat gives it, then one blank line, then the second reply.
    assert two.stdout.startswith(one.stdout + "\n") and two.stdout[len(one.stdout) + 1:].strip(), repr(two.stdout)
