"""The report of `cupy-llama bench`: speed-ups, where the run happened, and the table."""
from __future__ import annotations

import json
import os
import platform
import subprocess
from pathlib import Path

import numpy as np

from ..errors import RequestError


def write_report(json_path: str, report: dict) -> None:
    """The report as JSON at --json's path (a failure names the flag)."""
    try:
        Path(json_path).expanduser().write_text(json.dumps(report, indent=2) + "\n")
    except OSError as e:
        raise RequestError(f"cannot write {json_path!r} ({e.strerror or e}); pick another "
                           "--json") from None


def output_json_path(explicit: str | None, file_name: str) -> str | None:
    """Where a measuring script writes its JSON: --json's path, else file_name in the
    folder $OUT names where that is set, else nowhere (None)."""
    if explicit:
        return explicit
    out_dir = os.environ.get("OUT")
    return os.path.join(out_dir, file_name) if out_dir else None


def add_ratios(results: dict) -> None:
    """How many times faster cupy-llama is, per mode (None where a side is missing)."""
    def ratio(ours, theirs):
        return ours / theirs if ours and theirs else None

    for mode, sides in results.items():
        ours, theirs = sides["cupy_llama"], sides.get("transformers") or {}
        if "error" in theirs:
            continue
        if mode == "throughput":
            sides["speedup"] = ratio(ours["output_tok_s"], theirs.get("output_tok_s"))
        elif mode == "latency":
            sides["speedup"] = ratio(ours["tok_s"], theirs.get("tok_s"))
        elif mode == "ttft":
            sides["speedup"] = {str(a["prompt_tokens"]): ratio(b["ttft_ms"], a["ttft_ms"])
                                for a, b in zip(ours["prompts"], theirs.get("prompts", []))}
        elif mode == "decode-sweep":
            sides["speedup"] = {str(a["batch"]): ratio(a["tok_s"], b["tok_s"])
                                for a, b in zip(ours["rows"], theirs.get("rows", []))}


# ---- what the report says about the run ---------------------------------------------------

# the folder that holds the cupy_llama package: a checkout's root, where its .git is
SOURCE_ROOT = Path(__file__).resolve().parents[2]


def commit_info(explicit: str | None) -> dict:
    """The commit: --commit (else $CUPY_LLAMA_COMMIT) when given, with what git says beside
    it where that differs or the tree has uncommitted changes (a copied tree can carry a
    stale .git); else `git rev-parse HEAD` of this source tree, marked -dirty with
    uncommitted changes."""
    named = explicit or os.environ.get("CUPY_LLAMA_COMMIT")
    source = "--commit" if explicit else "CUPY_LLAMA_COMMIT"
    git = git_commit(SOURCE_ROOT)
    if named:
        info = {"commit": named, "commit_source": source}
        if git is not None and (not git.startswith(named) or git.endswith("-dirty")):
            info["git_reported"] = git
        return info
    if git is not None:
        return {"commit": git, "commit_source": "git"}
    return {"commit": "unknown", "commit_source": "none"}


def git_commit(root: Path) -> str | None:
    """HEAD of the git checkout at root (+ "-dirty" with uncommitted changes), or None."""
    if not (root / ".git").exists():
        return None
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"],
                              capture_output=True, text=True, timeout=10)
        status = subprocess.run(["git", "-C", str(root), "status", "--porcelain",
                                 "--untracked-files=no"], capture_output=True, text=True,
                                timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if head.returncode != 0 or not head.stdout.strip():
        return None
    dirty = "-dirty" if status.returncode == 0 and status.stdout.strip() else ""
    return head.stdout.strip() + dirty


def environment(device: str, hf: bool) -> dict:
    from .. import __version__
    env = {"cupy_llama": __version__, "python": platform.python_version(),
           "numpy": np.__version__, "platform": platform.platform()}
    if device == "cuda":
        import cupy
        env.update(cupy=cupy.__version__, cuda_runtime=cupy.cuda.runtime.runtimeGetVersion(),
                   cuda_driver=cupy.cuda.runtime.driverGetVersion())
    if hf:
        import torch
        import transformers
        env.update(torch=torch.__version__, transformers=transformers.__version__,
                   torch_cuda=torch.version.cuda)
    return env


# ---- the table ----------------------------------------------------------------------------

def format_table(report: dict) -> str:
    """A short summary of the report: one row per number, both engines side by side."""
    rows = [("", "", "cupy-llama", "transformers", "speed-up")]
    results, timings = report["results"], report["timings"]
    for mode in results:  # in the order the modes ran
        rows += TABLE_ROWS[mode](results[mode])
    hf = report.get("transformers")
    columns = 5 if hf else 3
    width = [max(len(r[i]) for r in rows) for i in range(columns)]
    lines = [f"cupy-llama bench on {report['device']['name']} ({report['device']['kind']}), "
             f"commit {_short(report['commit'])}, model {_model_name(report['model'])}",
             f"load {timings['load_s']:.2f} s, warm-up {timings['warmup_s']:.2f} s"]
    if hf:
        lines.append(f"transformers {hf['version']} ({hf['attn_implementation']} attention, "
                     f"{hf['dtype']}), loaded in {hf['load_s']:.2f} s")
    for r in rows:
        cells = [f"{r[0]:<{width[0]}}", f"{r[1]:<{width[1]}}"]
        cells += [f"{r[i]:>{width[i]}}" for i in range(2, columns)]
        lines.append("  ".join(cells).rstrip())
    lines += _memory_lines(report["memory"])
    return "\n".join(lines)


def _short(commit: str) -> str:
    sha, dirty, _ = commit.partition("-dirty")
    return sha[:12] + dirty


def _model_name(model: dict) -> str:
    kind = f"random {model['random_preset']}" if model["random_preset"] else model["dir"]
    n = model["num_parameters"]
    size = f"{n / 1e9:.3f} B" if n >= 1e9 else f"{n / 1e6:.2f} M"
    return f"{kind} ({size} parameters)"


def _num(value, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _x(value) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _throughput_rows(r: dict) -> list:
    ours, theirs = r["cupy_llama"], r.get("transformers") or {}
    return [("throughput", "output tok/s", _num(ours["output_tok_s"]),
             _num(theirs.get("output_tok_s")) if "error" not in theirs else "failed",
             _x(r.get("speedup"))),
            ("", "total tok/s", _num(ours["total_tok_s"]), _num(theirs.get("total_tok_s")), ""),
            ("", "requests/s", _num(ours["requests_s"], 2), _num(theirs.get("requests_s"), 2), ""),
            ("", "wall time (s)", _num(ours["wall_s"], 2), _num(theirs.get("wall_s"), 2), "")]


def _latency_rows(r: dict) -> list:
    ours, theirs = r["cupy_llama"], r.get("transformers") or {}
    rows = [("latency", "decode tok/s, batch 1", _num(ours["tok_s"], 1),
             _num(theirs.get("tok_s"), 1) if "error" not in theirs else "failed",
             _x(r.get("speedup"))),
            ("", "ms per token", _num(ours["ms_per_token"], 3),
             _num(theirs.get("ms_per_token"), 3), "")]
    if "floor_tok_s" in ours:  # the GPU's; the CPU has none
        rows.append(("", f"of the bandwidth floor ({_num(ours['floor_tok_s'])} tok/s)",
                     f"{100 * ours['fraction_of_floor']:.1f}%", "", ""))
    return rows


def _ttft_rows(r: dict) -> list:
    ours, theirs = r["cupy_llama"], r.get("transformers") or {}
    speedup = r.get("speedup") or {}
    theirs_ms = {row["prompt_tokens"]: row["ttft_ms"] for row in theirs.get("prompts", [])}
    return [("ttft" if i == 0 else "", f"{row['prompt_tokens']}-token prompt (ms)",
             _num(row["ttft_ms"], 2), _num(theirs_ms.get(row["prompt_tokens"]), 2),
             _x(speedup.get(str(row["prompt_tokens"]))))
            for i, row in enumerate(ours["prompts"])]


def _sweep_rows(r: dict) -> list:
    ours, theirs = r["cupy_llama"], r.get("transformers") or {}
    speedup = r.get("speedup") or {}
    theirs_rate = {row["batch"]: row["tok_s"] for row in theirs.get("rows", [])}
    return [("decode-sweep" if i == 0 else "", f"batch {sweep_batch(row)} tok/s",
             _num(row["tok_s"]), _num(theirs_rate.get(row["batch"])),
             _x(speedup.get(str(row["batch"]))))
            for i, row in enumerate(ours["rows"])]


def sweep_batch(row: dict) -> str:
    """A sweep row's batch size, or what ran when it exceeded max_num_seqs: that many
    sequences, max_num_seqs at a time."""
    if row.get("one_batch", True):
        return str(row["batch"])
    return f"{row['batch']} ({row['max_num_seqs']} at a time)"


def _prefix_rows(r: dict) -> list:
    """Prefix caching on / off, side by side in cupy-llama's column."""
    ours = r["cupy_llama"]
    on, off = ours["cached"], ours["uncached"]

    def pair(part, key, digits=2):
        return f"{_num(on[part][key], digits)} / {_num(off[part][key], digits)}"

    shared = f"{ours['requests']} x ({ours['shared_tokens']} shared + {ours['suffix_tokens']})"
    turns = ours["chat_turns"]
    return [("prefix", f"{shared}: first TTFT ms, cache on / off",
             pair("shared_prefix", "first_ttft_ms")),
            ("", "the rest: median TTFT ms", pair("shared_prefix", "rest_ttft_ms_median")),
            ("", "output tok/s", pair("shared_prefix", "output_tok_s", 0)),
            ("", f"{turns}-turn chat: turn-1 TTFT ms", pair("chat", "turn1_ttft_ms")),
            ("", f"turn-{turns} TTFT ms", pair("chat", "last_turn_ttft_ms")),
            ("", "prompt tokens from the cache",
             f"{100 * on['hit_rate']:.0f}% / {100 * off['hit_rate']:.0f}%")]


TABLE_ROWS = {"throughput": _throughput_rows, "latency": _latency_rows, "ttft": _ttft_rows,
              "decode-sweep": _sweep_rows, "prefix": _prefix_rows}


def _gib(n) -> str:
    return "-" if n is None else f"{n / 2**30:.2f} GiB"


def _memory_lines(memory: dict) -> list[str]:
    plan = ", ".join(f"{row['name']} {_gib(row['bytes'])}" for row in memory["plan"]
                     if not row["name"].startswith("pool: "))
    pool = sum(row["bytes"] for row in memory["plan"] if row["name"].startswith("pool: "))
    if memory.get("peak_used_bytes") is not None:
        return [f"memory: peak {_gib(memory['peak_used_bytes'])} in use on the device "
                f"({_gib(memory['used_before_load_bytes'])} before load): {plan}, buffers "
                f"{_gib(pool)}, other {_gib(memory['unplanned_bytes'])} (CUDA graphs, cuBLAS, "
                "kernels)"]
    return [f"memory: peak RSS {_gib(memory.get('peak_rss_bytes'))}: {plan}"]
