"""``benchmarks.harness``: the lab scripts' sections under one time budget, their
``results.json`` and summaries, and the command-line options they share."""

from __future__ import annotations

import argparse
import json

import pytest

from benchmarks.harness import Run, add_run_args, parse_sections


def _saved(run: Run) -> dict:
    return json.loads((run.out / "results.json").read_text())


def test_sections_run_fail_and_skip_without_stopping_the_run(tmp_path):
    cleaned: list[int] = []
    run = Run(tmp_path / "out", budget_s=100.0, results={"suite": "x"},
              cleanup=lambda: cleaned.append(1))
    assert run.section("first", lambda: 41 + 1) == 42
    assert _saved(run)["timings_s"].keys() == {"first"}  # written after the section

    def broken() -> None:
        raise ValueError("no device")

    assert run.section("broken", broken) is None
    assert run.section("too long", lambda: pytest.fail("must not run"), need_s=1e6) is None
    assert run.section("last", lambda: "ran") == "ran"
    saved = _saved(run)
    assert list(saved) == ["suite", "errors", "skipped", "timings_s"]
    assert saved["errors"].keys() == {"broken"}
    assert saved["errors"]["broken"].startswith("ValueError: no device\nTraceback")
    assert len(saved["skipped"]) == 1 and saved["skipped"][0].startswith("too long: ")
    assert saved["skipped"][0].endswith("s left, needs ~1000000")
    assert saved["timings_s"].keys() == {"first", "broken", "last"}
    assert cleaned == [1, 1, 1]  # after every section that ran, failed ones included


def test_unselected_sections_are_listed_only_when_asked(tmp_path):
    quiet = Run(tmp_path / "a", 100.0, select=lambda name: name == "kept")
    noted = Run(tmp_path / "b", 100.0, select=lambda name: name == "kept", note_unselected=True)
    for run in (quiet, noted):
        assert run.section("kept", lambda: 1) == 1
        assert run.section("other", lambda: pytest.fail("must not run")) is None
    assert quiet.results["skipped"] == []
    assert noted.results["skipped"] == ["other: not selected by --only"]


def test_summaries_are_rewritten_with_the_results_and_a_failing_one_is_logged(tmp_path, capsys):
    def broken(results: dict) -> str:
        raise KeyError("engines")

    run = Run(tmp_path, 100.0, summaries={
        "summary.md": lambda r: f"{len(r['timings_s'])} sections\n", "bad.md": broken})
    run.section("one", lambda: None)
    assert (tmp_path / "summary.md").read_text() == "1 sections\n"
    run.section("two", lambda: None)
    assert (tmp_path / "summary.md").read_text() == "2 sections\n"
    assert not (tmp_path / "bad.md").exists()
    assert "!! bad.md: KeyError" in capsys.readouterr().out


def test_run_arguments():
    ap = argparse.ArgumentParser()
    add_run_args(ap, out_default=None, budget_s=60.0, sections=True)
    args = ap.parse_args(["--out", "d", "--sections", "a, b,,c"])
    assert (args.out, args.budget_s, parse_sections(args.sections)) == ("d", 60.0, ["a", "b", "c"])
    with pytest.raises(SystemExit):  # --out is required without a default
        ap.parse_args([])
    plain = argparse.ArgumentParser()
    add_run_args(plain, out_default="bench_out")
    assert vars(plain.parse_args([])) == {"out": "bench_out"}
    assert parse_sections(None) is None and parse_sections(" , ") is None
