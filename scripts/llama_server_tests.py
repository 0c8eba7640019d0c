#!/usr/bin/env python3
"""Runs llama.cpp's own server tests against `graftlm serve` and against the real llama-server, on
the same model swap, and prints the two pass counts side by side with a reason bucket for each
failure.

    python scripts/llama_server_tests.py                         # both targets, every test file
    python scripts/llama_server_tests.py --target graftlm unit/test_completion.py
    python scripts/llama_server_tests.py --table OUT/graftlm.xml OUT/llama-server.xml

It needs a Python with the suite's requirements (pytest, requests, aiohttp, openai, wget, numpy,
filelock, prometheus-client; pytest-timeout if present) as --pytest-python, and one with graftlm's
dependencies as --graftlm-python. The suite lives in ../shared/llama.cpp/server-tests (read-only):
each target gets a copy under --work, where:

- `conftest.py`'s session fixture that pre-downloads every preset's model is made a no-op
  (nothing can be downloaded offline; the shim swaps the models instead, see llama_server_shim.py);
- `tmp/` is seeded with the files the tests `download_file()`: the pirate adapter of SmolLM2 under
  the name of the LoRA test_lora.py downloads, SmolLM2 itself as the draft model of
  test_speculative.py.

A test runs with a 180 s limit (pytest-timeout) so that a hung server fails one test, not the run.
The real llama-server runs from a copy of its bin/ folder without the sapphirerapids CPU variant
(on these VMs, AVX-512 without AMX granted, that variant can be picked and die with an illegal
instruction).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared"
SUITE = SHARED / "llama.cpp" / "server-tests"
LLAMA_BIN = SHARED / "llama.cpp" / "bin"
PIRATE = SHARED / "fixtures" / "smollm2" / "pirate-f32.gguf"

# Tests that cannot apply here, whatever the server: each with its reason. Deselected for both
# targets, so the two counts are over the same tests.
OUT_OF_SCOPE: dict[str, str] = {
    "unit/test_router.py": "router mode (a models directory, models loaded and unloaded on "
    "demand, each downloaded from Hugging Face)",
    "unit/test_stream.py": "router mode (resumable conversation streams over several models)",
    "unit/test_mcp_servers.py": "MCP servers: the web UI's tool servers spawned by llama-server",
    "unit/test_tools_builtin.py": "built-in tools run in containers, in router mode",
    "unit/test_proxy.py": "the web UI's CORS proxy to arbitrary URLs",
    "unit/test_vision_api.py": "vision: a multimodal model and its mmproj, downloaded",
    "unit/test_systemone.py": "tinylaya/tinyopenjev-specific features with images, downloaded",
    "unit/test_compat_anthropic.py::test_anthropic_vision_base64_with_multimodal_model": "vision",
    "unit/test_security.py::test_local_media_file": "vision: local media files for a multimodal "
    "model",
    "unit/test_slot_save.py::test_slot_save_restore_with_image_across_restart": "vision",
    "unit/test_slot_save.py::test_slot_save_restore_image_payload_larger_than_context": "vision",
    "unit/test_slot_save.py::test_slot_restore_media_file_without_mmproj": "vision",
}

# Failures of graftlm that llama-server passes on the same swap, known and kept: each with why (a
# test id, or the start of a parametrized one). The table prints the reason beside the failure.
_POOL = (
    "-c is a KV pool any one sequence may fill (paged), so the limit the error reports is 512, "
    "not -c / -np = 256"
)
EXPLAINED: dict[str, str] = {
    "unit/test_chat_completion.py::test_context_size_exceeded": _POOL,
    "unit/test_chat_completion.py::test_context_size_exceeded_stream": _POOL,
    "unit/test_compat_anthropic.py::test_anthropic_empty_messages": "an empty `messages` list is "
    "a client's mistake: graftlm answers 400 where llama-server generates from nothing",
    "unit/test_compat_anthropic.py::test_anthropic_tool_result_with_image": "an image sent to a "
    "text-only model is a client's mistake: 400 here, the test wants llama-server's 500",
    "unit/test_compat_anthropic.py::test_anthropic_vision_format_accepted": "an image sent to a "
    "text-only model is a client's mistake: 400 here, the test wants llama-server's 500",
    "unit/test_completion.py::test_completion_unified[256-4-": "sampled at the preset's "
    "temperature, graftlm's random stream meets EOS at token 87 of the 90 asked (llama.cpp's "
    "stream happens not to); the shared pool itself serves the four requests",
    "unit/test_kv_keep_only_active.py::test_clear_and_restore": "reads llama-server's debug log "
    "tags of moving idle slots to host RAM; the paged prefix cache keeps idle prefixes in the "
    "pool, with no such event",
    "unit/test_metrics.py::test_metrics_disabled": "/metrics is on by default here "
    "(--no-metrics turns it off); llama-server needs --metrics",
    "unit/test_metrics.py::test_metrics_prompt_processed_and_cached": "the prefix cache reuses "
    "whole blocks of 16 tokens, and the test's 10-token prompt has none",
    "unit/test_security.py::test_cors_proxy_only_forwards_explicit_proxy_headers": "the web "
    "UI's CORS proxy to arbitrary URLs is not served (out of scope, as test_proxy.py)",
    "unit/test_slot_save.py::": "slot save and restore (KV state to files, --slot-save-path) "
    "is not implemented",
}


def explained(nodeid: str) -> str | None:
    """Why this failure is kept (EXPLAINED: the test's id, its parametrized ids, or an id's start
    ending in "::", "[" or "-"), or None."""
    for key, why in EXPLAINED.items():
        if nodeid == key or nodeid.startswith(key + "["):
            return why
        if key.endswith(("::", "[", "-")) and nodeid.startswith(key):
            return why
    return None


BUCKETS = (
    "model swap",
    "offline",
    "missing endpoint",
    "missing flag",
    "field",
    "status",
    "behaviour",
    "crash",
)


@dataclass
class Result:
    nodeid: str
    outcome: str  # passed, failed, skipped
    message: str = ""
    text: str = ""  # the failure's traceback and the captured output


def _nodeid(case: ET.Element) -> str:
    cls = case.get("classname", "")
    name = case.get("name", "")
    path = cls.replace(".", "/") + ".py"
    return f"{path}::{name}"


def read_junit(path: Path) -> dict[str, Result]:
    out: dict[str, Result] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        nid = _nodeid(case)
        outcome, message, text = "passed", "", ""
        for tag in ("failure", "error"):
            el = case.find(tag)
            if el is not None:
                outcome = "failed"
                message = el.get("message", "") or ""
                text = (
                    (el.text or "")
                    + "\n"
                    + "".join((o.text or "") for o in case.iter("system-out"))
                )
                break
        if case.find("skipped") is not None and outcome == "passed":
            outcome = "skipped"
        out[nid] = Result(nid, outcome, message, text)
    return out


def bucket(r: Result, control: Result | None) -> str:
    """The reason bucket of a failure, from its message (a heuristic, written to be read)."""
    m, t = r.message, r.text
    if "Server process died" in m or "Server did not start" in m:
        if re.search(r"unrecognized arguments|error: argument|invalid choice", t):
            return "missing flag"
        if control is None or control.outcome != "failed":
            return "crash"
    if control is not None and control.outcome == "failed":
        # llama-server fails it too: a file it cannot have here, or the swapped model's output
        if re.search(r"huggingface\.co|Server process died", control.message):
            return "offline"
        return "model swap"
    if re.search(r"Timeout|timed out|ConnectionError|RemoteDisconnected|Connection reset", m):
        return "crash"
    if re.search(r"\b(404|405)\b", m):
        return "missing endpoint"
    if re.search(r"status_code|ServerError|\b(400|401|403|413|422|500|501|503)\b", m):
        return "status"
    if re.search(r"KeyError|TypeError: 'NoneType'| in res\.body| not in |Expected .* in chunk", m):
        return "field"
    return "behaviour"


def one_line(r: Result) -> str:
    m = " ".join(r.message.split())
    return m[:160] + ("..." if len(m) > 160 else "")


def table(graft: dict[str, Result], llama: dict[str, Result] | None) -> str:
    files = sorted({n.split("::")[0] for n in graft} | {n.split("::")[0] for n in llama or {}})
    lines = ["| test file | tests | graftlm | llama-server |", "|---|---:|---:|---:|"]
    tot = Counter[str]()
    for f in files:
        g = [r for n, r in graft.items() if n.startswith(f + "::") and r.outcome != "skipped"]
        ll = [r for n, r in (llama or {}).items() if n.startswith(f + "::")]
        ll = [r for r in ll if r.outcome != "skipped"]
        gp = sum(r.outcome == "passed" for r in g)
        lp = sum(r.outcome == "passed" for r in ll)
        n = max(len(g), len(ll))
        tot.update(n=n, g=gp, l=lp)
        lines.append(f"| {f.removeprefix('unit/')} | {n} | {gp} | {lp if llama else '-'} |")
    lines.append(f"| **total** | **{tot['n']}** | **{tot['g']}** | **{tot['l']}** |")
    buckets = Counter[str]()
    fails = []
    unexplained = 0
    for nid, r in sorted(graft.items()):
        if r.outcome == "failed":
            control = (llama or {}).get(nid)
            b = bucket(r, control)
            buckets[b] += 1
            why = explained(nid) if b not in ("model swap", "offline") else None
            if why is None and b not in ("model swap", "offline"):
                unexplained += 1
            note = f" (kept: {why})" if why else ""
            fails.append(f"- {nid.removeprefix('unit/')} [{b}]{note}: {one_line(r)}")
    lines += [
        "",
        "graftlm failures by bucket: "
        + ", ".join(f"{b} {buckets[b]}" for b in BUCKETS if buckets[b])
        or "none",
    ]
    if llama:
        only_llama = [
            n
            for n, r in llama.items()
            if r.outcome == "failed" and graft.get(n) is not None and graft[n].outcome == "passed"
        ]
        lines.append(f"passed by graftlm, failed by llama-server: {len(only_llama)}")
    lines.append(
        f"failures neither a model swap, offline, nor explained (EXPLAINED): {unexplained}"
    )
    lines += ["", *fails]
    return "\n".join(lines)


def prepare(work: Path, target: str, graftlm_python: str, src: Path) -> Path:
    """A writable copy of the suite for one target, and the wrapper the tests launch."""
    dest = work / target
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(SUITE, dest)
    conftest = dest / "conftest.py"
    text = conftest.read_text()
    # the presets' pre-download: nothing to download offline (the shim swaps the models)
    text = text.replace("        ServerPreset.load_all()", "        pass  # offline: no download")
    conftest.write_text(text)
    tmp = dest / "tmp"
    tmp.mkdir(exist_ok=True)
    shutil.copy(PIRATE, tmp / "moe_shakespeare15M.gguf")  # test_lora.py's LoRA
    smollm2 = subprocess.run(
        [graftlm_python, "-c", "from graftlm.resources import default_model_path as p; print(p())"],
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    os.symlink(smollm2, tmp / "stories15M-q4_0.gguf")  # test_speculative.py's draft
    env_lines = [
        f"export GRAFTLM_PYTHON={graftlm_python}",
        f"export GRAFTLM_SRC={src}",
        f"export SMOLLM2_GGUF={smollm2}",
        f"export LLAMA_TEMPLATES={SUITE.parent / 'models' / 'templates'}",
    ]
    if target == "llama-server":
        bindir = work / "llama-bin"
        if not bindir.exists():
            shutil.copytree(LLAMA_BIN, bindir)
            (bindir / "libggml-cpu-sapphirerapids.so").unlink(missing_ok=True)
        env_lines.append(f"export LLAMA_SERVER_REAL={bindir / 'llama-server'}")
    wrapper = dest / "llama-server-shim"
    wrapper.write_text(
        "#!/bin/sh\n" + "\n".join(env_lines) + "\n"
        f"exec {graftlm_python} {ROOT / 'scripts' / 'llama_server_shim.py'} "
        f'--target={target} "$@"\n'
    )
    wrapper.chmod(0o755)
    return dest


def port_free(port: int) -> bool:
    """A server left on the port would answer the tests' /health in place of the one they start."""
    import socket

    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def run(target: str, tests: list[str], args: argparse.Namespace) -> Path:
    port = args.port + (0 if target == "graftlm" else 100)
    if not port_free(port):
        sys.exit(f"port {port} is in use (a server left from an earlier run?): free it first")
    src = ROOT / "src"
    if args.snapshot:  # the tree as it is now, so that edits during the run do not leak in
        src = Path(args.work) / "src"
        shutil.rmtree(src, ignore_errors=True)
        shutil.copytree(ROOT / "src", src, ignore=shutil.ignore_patterns("__pycache__"))
    dest = prepare(Path(args.work), target, args.graftlm_python, src)
    xml = Path(args.work) / f"{target}{'-rerun' if args.rerun_failed else ''}.xml"
    if args.rerun_failed:  # only what failed in an earlier run (tests are independent)
        old = read_junit(Path(args.rerun_failed))
        tests = [n for n, r in old.items() if r.outcome == "failed"]
    cmd = [
        args.pytest_python,
        "-m",
        "pytest",
        "-p",
        "no:cacheprovider",
        "-q",
        "-m",
        "not slow",
        "-o",
        "junit_logging=all",
        f"--junitxml={xml}",
        *(tests or ["unit"]),
    ]
    probe = subprocess.run([args.pytest_python, "-c", "import pytest_timeout"], capture_output=True)
    if probe.returncode == 0:
        cmd += ["--timeout", str(args.timeout)]
    for nid in OUT_OF_SCOPE:
        cmd += ["--deselect", nid] if "::" in nid else ["--ignore", nid]
    env = {
        **os.environ,
        "LLAMA_SERVER_BIN_PATH": str(dest / "llama-server-shim"),
        "PORT": str(port),
        "PYTHONUNBUFFERED": "1",
    }
    log = Path(args.work) / f"{target}.log"
    print(f"{target}: {' '.join(cmd)} (log {log})", file=sys.stderr, flush=True)
    with open(log, "w") as f:
        subprocess.run(cmd, cwd=dest, env=env, stdout=f, stderr=subprocess.STDOUT)
    return xml


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("tests", nargs="*", help="test files or node ids (default: unit/)")
    p.add_argument("--target", choices=["graftlm", "llama-server", "both"], default="both")
    p.add_argument("--work", default="/tmp/llama-server-tests")
    p.add_argument("--pytest-python", default=sys.executable)
    p.add_argument("--graftlm-python", default=sys.executable)
    p.add_argument("--port", type=int, default=8480)
    p.add_argument("--timeout", type=int, default=180)
    p.add_argument("--snapshot", action="store_true", help="run a copy of src/ taken at start")
    p.add_argument(
        "--rerun-failed",
        metavar="XML",
        help="run only the tests that failed in this earlier run (into TARGET-rerun.xml)",
    )
    p.add_argument(
        "--table",
        nargs="+",
        metavar="XML",
        help="print the table of saved runs: GRAFTLM.xml[,RERUN.xml] [LLAMA-SERVER.xml] (a "
        "rerun's results replace the earlier ones)",
    )
    args = p.parse_args()
    # absolute (not resolved: a venv's python is a link that must stay one), since the tests
    # start the shim from their own folder
    args.graftlm_python = os.path.abspath(args.graftlm_python)
    args.pytest_python = os.path.abspath(args.pytest_python)
    if args.table:
        graft = {}
        for part in args.table[0].split(","):
            graft.update(read_junit(Path(part)))
        llama = read_junit(Path(args.table[1])) if len(args.table) > 1 else None
        print(table(graft, llama))
        return 0
    Path(args.work).mkdir(parents=True, exist_ok=True)
    xmls = {}
    for target in ("graftlm", "llama-server"):
        if args.target in (target, "both"):
            xmls[target] = run(target, args.tests, args)
    if args.rerun_failed:
        print(f"rerun results in {xmls}; merge them with --table OLD.xml,RERUN.xml")
        return 0
    graft_xml = xmls.get("graftlm", Path(args.work) / "graftlm.xml")
    llama_xml = xmls.get("llama-server", Path(args.work) / "llama-server.xml")
    if not graft_xml.exists():
        print(f"no graftlm results at {graft_xml}", file=sys.stderr)
        return 1
    print(table(read_junit(graft_xml), read_junit(llama_xml) if llama_xml.exists() else None))
    print("\nout of scope (deselected for both):")
    for nid, why in OUT_OF_SCOPE.items():
        print(f"- {nid.removeprefix('unit/')}: {why}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
