"""The `tinyloop` command on the bundled model, run as a user would run it."""
import json
import re
import subprocess
import sys



def tinyloop_cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "scripts.cli", *args], capture_output=True, text=True, timeout=timeout)


def test_generate_prints_continuation_and_stats():
    out = tinyloop_cli("generate", "def fibonacci(n):", "--max-tokens", "24")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("def fibonacci(n):") and len(out.stdout) > len("def fibonacci(n):") + 10
    assert "stop=" in out.stderr and "tok/s" in out.stderr and "loops 8.00" in out.stderr


def test_generate_speculative_matches_plain_greedy_and_shows_the_acceptance_rate():
    """(A malformed --speculative and an out-of-range --loops are test_edges.py's
    test_generate_validates_before_printing_anything.)"""
    plain = tinyloop_cli("generate", "import os", "--max-tokens", "16")
    spec = tinyloop_cli("generate", "import os", "--max-tokens", "16", "--speculative", "2:8:3")
    assert spec.returncode == 0, spec.stderr
    assert spec.stdout == plain.stdout
    assert re.search(r"speculative: \d+/\d+ drafted tokens accepted \(\d+%\), [\d.]+ tokens per verify step", spec.stderr)


def test_generate_with_grammar_and_beam():
    out = tinyloop_cli("generate", "x = ", "--max-tokens", "12", "--grammar", "[0-9]{3}", "--beam-size", "2")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("x = ")
    digits = out.stdout[len("x = "):].strip()
    assert len(digits) == 3 and digits.isdigit() and "grammar_complete" in out.stderr


def test_inspect_shows_config_beta_losses_and_cache_costs():
    out = tinyloop_cli("inspect")
    assert out.returncode == 0, out.stderr
    for needle in ("d_model", "parameters:", "beta:", "held-out loss by loops:", "loops  8:", "int4", "per slot"):
        assert needle in out.stdout
    bad = tinyloop_cli("inspect", "/nonexistent.tinyloop")
    assert bad.returncode == 2 and "no such artifact" in bad.stderr


def test_bench_quick_prints_ratios_and_plots_only_decode_rows(tmp_path):
    """The decode and cache-agreement sections in one run: the decode ratios printed, the agreement in the JSON, and
    --plot of sections that measured no decode rows an error that says what to run, not an empty picture."""
    out = tinyloop_cli("bench", "--quick", "--section", "decode", "--section", "cache_agreement", "--json",
                       str(tmp_path / "b.json"), "--plot", str(tmp_path / "b.png"), timeout=600)
    assert "naive" in out.stdout and out.stdout.count("x ") >= 9, out.stderr  # 3 loop counts x 3 cache modes
    assert out.returncode == 2 and "--peers" in out.stderr and "Traceback" not in out.stderr, out.stderr
    res = json.loads((tmp_path / "b.json").read_text())
    assert list(res["sections"]) == ["decode", "cache_agreement"]
    assert res["sections"]["cache_agreement"]["lines"][0].startswith("greedy agreement") and not (tmp_path / "b.png").exists()


def test_bench_depth_quick_gives_every_figure_with_the_same_tokens(tmp_path):
    """`tinyloop bench --section depth`: every figure of issue 31 for both models, in the JSON too, each early-exit
    run's tokens equal with loop-iteration steps and with token steps, and the mixed-depth requests' tokens equal
    to the same requests run in depth-homogeneous groups."""
    out = tinyloop_cli("bench", "--quick", "--section", "depth", "--json", str(tmp_path / "d.json"), timeout=600)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("tokens equal: yes") == 12 and "tokens equal: NO" not in out.stdout
    data = json.loads((tmp_path / "d.json").read_text())["sections"]["depth"]["data"]
    for model in ("bundled", "forced"):
        got = data[model]
        for key in ("early_exit_b1_now", "early_exit_b16_now", "mixed_now"):
            assert all(v > 0 for v in got[key].values()), (model, key, got[key])
        for key in ("early_lane_iterations_now", "uniform_at_mean_lane_iterations_now", "early_lane_iterations_same_depth_now",
                    "shallow_now"):
            assert got[key] > 0, (model, key)
    assert data["served_shallow_now"] > 0


def test_service_commands_refuse_bad_endpoints_and_taken_ports_in_one_line(tmp_path):
    """A typo in --connect, a key directory without the client's keys, a metrics port another process holds: one
    error line naming the option, exit 2, no traceback and (the gateway) no banner first."""
    import socket

    keys = tmp_path / "keys"
    keys.mkdir()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = str(taken.getsockname()[1])
        for args, needle in [
            (["submit", "--connect", "bogus", "hi"], "--connect: cannot connect to 'bogus'"),
            (["status", "--connect", "tcp://127.0.0.1:notaport"], "--connect: cannot connect to 'tcp://127.0.0.1:notaport'"),
            (["gateway", "--connect", "bogus", "--port", "0"], "--connect: cannot connect to 'bogus'"),
            (["status", "--connect", "tcp://127.0.0.1:1", "--curve-dir", str(keys)], f"--curve-dir: CURVE key directory "
                                                                                     f"{keys} has no client.key_secret"),
            (["broker", "--frontend", f"ipc://{tmp_path}/f", "--backend", f"ipc://{tmp_path}/b", "--metrics-port", port],
             f"error: --metrics-port {port}: cannot listen on 127.0.0.1:{port}"),
            (["gateway", "--connect", "tcp://127.0.0.1:1", "--port", "0", "--metrics-port", port],
             f"error: --metrics-port {port}: cannot listen on 127.0.0.1:{port}"),
        ]:
            out = tinyloop_cli(*args, timeout=60)
            assert out.returncode == 2 and needle in out.stderr, (args, out.stderr)
            assert "Traceback" not in out.stderr and "gateway: http" not in out.stderr, out.stderr
