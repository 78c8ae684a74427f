"""The real ``cachegen`` command in subprocesses, as a user runs it.

Every user mistake must give one line on stderr, exit status 2 and no
traceback, before any model loads (so these tests are fast); --json - must
give JSON alone on stdout; a closed pipe and Ctrl-C must end quietly.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

BIN = Path(sys.executable).with_name("cachegen")
CMD = [str(BIN)] if BIN.exists() else [sys.executable, "-m", "cachegen"]


@pytest.fixture
def env(tmp_path):
    e = dict(os.environ)
    e["CACHEGEN_HOME"] = str(tmp_path / "home")
    e.pop("PYTHONWARNINGS", None)
    return e


def cachegen(env, *args, timeout=120, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([*CMD, *map(str, args)], env=env, capture_output=True, text=True, timeout=timeout, **kw)


def assert_user_error(r: subprocess.CompletedProcess, *words: str) -> None:
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert len(lines) == 1, r.stderr
    assert "Traceback" not in r.stderr
    assert lines[0].startswith("cachegen"), lines
    for w in words:
        assert w in lines[0], (w, lines[0])


# -- version, help, imports ---------------------------------------------------------


def test_version(env):
    from cachegen import __version__

    r = cachegen(env, "--version")
    assert r.returncode == 0 and r.stdout.strip() == f"cachegen {__version__}"


def test_help_lists_every_command_and_every_option_has_help(env):
    r = cachegen(env, "--help")
    assert r.returncode == 0, r.stderr
    for c in ("demo", "models", "store", "bench", "serve"):
        assert c in r.stdout
    r = cachegen(env, "bench", "--help")
    assert r.returncode == 0
    for c in ("quality", "needle", "ttft", "codec", "stream", "all"):
        assert c in r.stdout


def test_options_of_my_commands_have_help_and_shared_names():
    from cachegen.cli.main import _walk, build_parser

    p = build_parser(["bench", "quality"])
    mine = {
        "cachegen demo",
        "cachegen models",
        "cachegen bench quality",
        "cachegen bench needle",
        "cachegen bench ttft",
        "cachegen bench all",
    }
    seen = set()
    for q in _walk(p):
        if q.prog not in mine:
            continue
        seen.add(q.prog)
        for a in q._actions:
            assert a.help, (q.prog, a.option_strings)
            assert not {"--gbps", "--slo", "--bandwidth"} & set(a.option_strings), (q.prog, a.option_strings)
    assert seen == mine
    demo = next(q for q in _walk(p) if q.prog == "cachegen demo")
    flags = {s for a in demo._actions for s in a.option_strings}
    assert {"--chunk-tokens", "--bandwidth-gbps", "--slo-s", "--store", "--model", "--json", "-v", "-q"} <= flags


def test_shared_defaults_match_the_library():
    from cachegen.cli import options
    from cachegen.engine.models import DEFAULT_MODEL
    from cachegen.store.keys import DEFAULT_CHUNK_TOKENS

    assert options.DEFAULT_MODEL == DEFAULT_MODEL
    assert options.DEFAULT_CHUNK_TOKENS == DEFAULT_CHUNK_TOKENS


def test_cli_imports_no_torch():
    code = (
        "import sys, cachegen, cachegen.cli.main as m; m.build_parser(['--help']); "
        "print(sorted(k for k in ('torch', 'transformers', 'numba') if k in sys.modules))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


# -- user mistakes: one line, status 2, before any model load -----------------------


def test_unknown_command_and_bad_option_values(env):
    assert_user_error(cachegen(env, "frobnicate"), "invalid choice")
    assert_user_error(cachegen(env, "demo", "--context-tokens", "lots"), "--context-tokens")
    assert_user_error(cachegen(env, "demo", "--bandwidth-gbps", "0"), "--bandwidth-gbps")
    assert_user_error(cachegen(env, "demo", "--slo-s", "-1"), "--slo-s")
    assert_user_error(cachegen(env, "bench", "ttft", "--bandwidth-gbps", "1,x"), "--bandwidth-gbps")
    assert_user_error(cachegen(env, "bench", "quality", "--dtype", "int3"), "--dtype")


def test_context_longer_than_the_model_takes(env):
    r = cachegen(env, "demo", "--context-tokens", "1000000")
    assert_user_error(r, "1000000", "8192")


def test_unknown_model(env):
    assert_user_error(cachegen(env, "demo", "--model", "no-such-model"), "no-such-model", "smollm2-135m")


def test_bad_and_unreachable_store(env):
    assert_user_error(cachegen(env, "demo", "--store", "ftp://somewhere"), "ftp://somewhere")
    # nothing listens on port 1: refused before the model loads
    r = cachegen(env, "demo", "--store", "redis://:hunter2@127.0.0.1:1/0?timeout=0.5")
    assert_user_error(r)
    assert "hunter2" not in r.stderr


@pytest.mark.parametrize("kind", ["missing", "directory", "binary", "latin1", "empty"])
def test_bad_text_files(env, tmp_path, kind):
    f = tmp_path / "input.txt"
    if kind == "directory":
        f.mkdir()
    elif kind == "binary":
        f.write_bytes(b"\x7fELF\x00\x01\x02" * 100)
    elif kind == "latin1":
        f.write_bytes("caf\u00e9 cr\u00e8me br\u00fbl\u00e9e ".encode("latin-1") * 20)
    elif kind == "empty":
        f.write_text("  \n\n")
    word = {
        "missing": "no such file",
        "directory": "directory",
        "binary": "binary",
        "latin1": "UTF-8",
        "empty": "empty",
    }[kind]
    assert_user_error(cachegen(env, "bench", "quality", "--text", f), word)


def test_checks_module_on_levels():
    import argparse

    from cachegen.cli import checks
    from cachegen.errors import ConfigError

    assert checks.levels_arg("1, 3,5") == (1, 3, 5)
    with pytest.raises(argparse.ArgumentTypeError, match="level"):
        checks.levels_arg("high")
    with pytest.raises(ConfigError, match="9"):
        checks.levels((1, 9))
    assert checks.levels((3, 1, 3)) == (3, 1)
    assert checks.levels(None) is None
    from cachegen.codec import LEVELS

    assert checks.LEVELS == LEVELS  # the CLI's copy, kept to refuse --levels without importing torch


# -- output ---------------------------------------------------------------------------


def test_models_lists_without_converting(env, tmp_path):
    r = cachegen(env, "models")
    assert r.returncode == 0, r.stderr
    assert "smollm2-135m" in r.stdout and "gemma3-270m" in r.stdout and "8192" in r.stdout
    home = tmp_path / "home"
    assert not any(home.rglob("*.gguf")) and not any(home.rglob("*.safetensors"))


def test_json_dash_writes_only_json_to_stdout(env):
    r = cachegen(env, "models", "--json", "-")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)  # nothing else on stdout
    assert {row["name"] for row in rows} >= {"smollm2-135m", "gemma3-270m"}
    assert "positions" in r.stderr  # the table went to stderr
    assert not Path("-").exists()


def test_closed_pipe_ends_quietly(env):
    """``cachegen models | head -0``: the reader is gone before the first write."""
    rd, wr = os.pipe()
    os.close(rd)
    try:
        p = subprocess.run([*CMD, "models"], env=env, stdout=wr, stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(wr)
    assert "Traceback" not in p.stderr and "Exception ignored" not in p.stderr, p.stderr
    assert p.returncode == 141


def test_head_one_in_a_shell(env):
    r = subprocess.run(
        f"{' '.join(CMD)} --help | head -1", shell=True, env=env, capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0 and r.stdout.startswith("usage: cachegen")
    assert "Traceback" not in r.stderr and "BrokenPipe" not in r.stderr


def test_verbosity_flags_on_every_command(env):
    from cachegen.cli.main import _walk, build_parser

    for q in _walk(build_parser(["bench", "codec"])):
        flags = set(q._option_string_actions)
        assert "-v" in flags and "-q" in flags, q.prog


# -- Ctrl-C ---------------------------------------------------------------------------


@pytest.mark.model
def test_ctrl_c_exits_130_and_the_next_run_starts_over(env, tmp_path):
    """Interrupting the one-time model conversion leaves no half-written copy."""
    p = subprocess.Popen(
        [*CMD, "models", "--prepare", "smollm2-135m"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # Ctrl-C as in a terminal: a suite started in the background by a non-interactive shell
        # (`make test &`) inherits SIGINT ignored, and Python then installs no KeyboardInterrupt
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        line = p.stderr.readline()  # "converting ... (once) ..." once the work has begun
        assert "converting" in line, line
        time.sleep(0.5)
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=60)
    finally:
        p.kill()
    assert p.returncode == 130, err
    assert "interrupted" in err and "Traceback" not in err
    models = tmp_path / "home" / "models"
    assert not (models / "smollm2-135m").exists()  # built in a temporary directory, renamed when complete


# -- logging and bugs ----------------------------------------------------------------


def test_verbose_shows_the_details_of_a_user_error(env):
    r = cachegen(env, "-v", "demo", "--model", "no-such-model")
    assert r.returncode == 2
    assert r.stderr.startswith("cachegen: error: unknown model 'no-such-model'")
    assert "debug cachegen.cli.main" in r.stderr and "ModelNotFound" in r.stderr


def test_logging_levels(monkeypatch):
    import logging

    from cachegen.cli.main import configure_logging

    log = logging.getLogger("cachegen.some.module")
    try:
        configure_logging()
        assert log.isEnabledFor(logging.INFO) and not log.isEnabledFor(logging.DEBUG)
        configure_logging(verbose=1)
        assert log.isEnabledFor(logging.DEBUG)
        configure_logging(quiet=True)
        assert not log.isEnabledFor(logging.WARNING) and log.isEnabledFor(logging.ERROR)
        assert not logging.getLogger("urllib3").isEnabledFor(logging.WARNING)
        ours = [h for h in logging.getLogger().handlers if getattr(h, "_cachegen", False)]
        assert len(ours) == 1  # configuring again replaces the handler
    finally:
        from cachegen import progress

        for h in [h for h in logging.getLogger().handlers if getattr(h, "_cachegen", False)]:
            logging.getLogger().removeHandler(h)
        logging.getLogger().setLevel(logging.WARNING)
        logging.getLogger("cachegen").setLevel(logging.NOTSET)
        progress.set_enabled(True)


def test_an_unexpected_exception_is_reported_as_a_bug(monkeypatch, capsys):
    from cachegen.cli import main as cli_main
    from cachegen.cli import models

    def broken(args):
        raise RuntimeError("something inside went wrong")

    monkeypatch.setattr(models, "run", broken)
    assert cli_main.main(["models"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "RuntimeError: something inside went wrong" in err and "a bug" in err


@pytest.mark.model
def test_loading_a_model_into_redirected_output_draws_no_bars(env, smollm2):
    """transformers' "Loading weights" bar and cachegen's spinner stay off when stderr is not a terminal."""
    r = cachegen(env, "models", "--prepare", smollm2.path)
    assert r.returncode == 0, r.stderr
    assert "\r" not in r.stderr and "Loading" not in r.stderr and "%|" not in r.stderr, r.stderr
    assert smollm2.fingerprint in r.stdout


def test_result_paths_are_checked_before_the_run(env, tmp_path):
    (tmp_path / "afile").write_text("x")
    assert_user_error(cachegen(env, "bench", "quality", "--json", tmp_path), "directory")
    assert_user_error(cachegen(env, "bench", "needle", "--plot", tmp_path / "afile" / "p.png"), "--plot")
    assert_user_error(cachegen(env, "bench", "all", "--out", tmp_path / "afile"), "--out")


def test_levels_are_checked_before_the_model_loads(env, tmp_path):
    f = tmp_path / "doc.txt"
    f.write_text("Some text to store. " * 50)
    assert_user_error(cachegen(env, "store", "ingest", f, "--levels", "high"), "--levels", "high")
    r = cachegen(env, "store", "ingest", f, "--levels", "1,9")
    assert_user_error(r, "9")
    assert not (tmp_path / "home" / "models").exists() or not any((tmp_path / "home" / "models").iterdir())


def test_codecs_are_checked_before_the_model_loads(env, tmp_path):
    assert_user_error(cachegen(env, "bench", "quality", "--codecs", "fp16,nope"), "nope")
    assert_user_error(cachegen(env, "bench", "ttft", "--codecs", "uniform8:3"), "uniform8", "3")
    assert_user_error(cachegen(env, "bench", "needle", "--codecs", "cachegen:x"), "cachegen:x")
    assert_user_error(cachegen(env, "bench", "all", "--codecs", "cachegen:9", "--out", tmp_path / "r"), "9")
    assert not (tmp_path / "r").exists()
    assert not (tmp_path / "home" / "models").exists() or not any((tmp_path / "home" / "models").iterdir())


def test_json_dash_for_a_bench_module_that_writes_its_own_file(tmp_path, monkeypatch, capsys):
    """A module in BENCHES that only knows how to write a path still gets --json - right."""
    (tmp_path / "cg_fake_bench.py").write_text(
        "import json\n"
        "def register(sub):\n"
        "    p = sub.add_parser('fake', help='a bench that writes its own JSON file')\n"
        "    p.add_argument('--json', help='path')\n"
        "    p.set_defaults(func=run)\n"
        "def run(args):\n"
        "    print('a table for people')\n"
        "    open(args.json, 'w').write(json.dumps({'rows': [1, 2]}))\n"
        "    return 0\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    from cachegen.bench import cli as bench_cli
    from cachegen.cli.main import main

    monkeypatch.setitem(bench_cli.BENCHES, "fake", ("cg_fake_bench", "fake"))
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "fake", "--json", "-"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out) == {"rows": [1, 2]} and "a table for people" in err
    assert not (tmp_path / "-").exists()
    assert main(["bench", "fake", "--json", "r.json"]) == 0
    assert json.loads((tmp_path / "r.json").read_text()) == {"rows": [1, 2]}


@pytest.mark.model
def test_count_tokens_uses_the_tokenizer_alone(smollm2, tmp_path, monkeypatch):
    from cachegen.cli import checks

    text = "Count these tokens, please. " * 10
    assert checks.count_tokens(str(smollm2.path), text) == len(smollm2.tokenizer(text)["input_ids"])
    monkeypatch.setenv("CACHEGEN_HOME", str(tmp_path))  # not converted here: only the engine can tell
    assert checks.count_tokens("smollm2-135m", text) is None
    from cachegen.errors import ConfigError

    with pytest.raises(ConfigError, match="at most 8192"):
        checks.context_length("smollm2-135m", 9000)
    checks.context_length("smollm2-135m", 8192)


def test_every_option_of_every_command_has_help_and_one_name_per_concept():
    """All commands, each lazily registered bench module included (built one at a time, as they run)."""
    from cachegen.bench.cli import BENCHES
    from cachegen.cli.main import _walk, build_parser

    old = {"--gbps", "--slo", "--bandwidth", "--verbose-requests"}
    checked = set()
    for argv in [["demo"], *(["bench", name] for name in BENCHES)]:
        for q in _walk(build_parser(argv)):
            for a in q._actions:
                if isinstance(a, argparse._SubParsersAction):
                    continue
                assert a.help, (q.prog, a.option_strings)
                assert not old & set(a.option_strings), (q.prog, a.option_strings)
            checked.add(q.prog)
    assert {f"cachegen bench {name}" for name in BENCHES} <= checked
