"""The Markdown page of a `python -m bench` result: one table per measurement, ratios beside the
numbers (bench/results/<device>.md)."""

from __future__ import annotations

from bench import host_cost


def markdown(result: dict) -> str:
    m = result["machine"]
    lines = [
        f"# ddp.bench on {', '.join(m['gpus']) or 'CPU only'} ({'quick' if result['quick'] else 'full'})",
        "",
        f"{m['date']}; CPU: {m['cpu']} ({m['cores']} cores); torch {m['torch']}; python {m['python']}.",
        f"Command: `{result['command']}`",
        *training(result),
        *compiled(result.get("compiled", [])),
        *data_path(result["data_path"]),
        *ddp(result["ddp"]),
        "",
        "## Startup",
        "",
        f"Process start to the end of the first training step: {result['startup']['startup_s']:.2f} s "
        f"({result['startup']['command']}).",
    ]
    if "host_cost" in result:
        lines += ["", "## The host's cost of a step (bench/host_cost.py)", "", host_cost.table(result["host_cost"])]
    if "time_to_accuracy" in result:
        lines += time_to_accuracy(result["time_to_accuracy"])
    return "\n".join(lines) + "\n"


def training(result: dict) -> list[str]:
    lines = [
        "",
        "## Training images/s",
        "",
        "| device | model | batch | ours (device data path) | one batch repeated | ours / one batch "
        "| tutorial pipeline | ours / tutorial | peak memory MB | MFU |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in result["train"]:
        mfu_text = f"{r['mfu']:.1%}" if "mfu" in r else "n/a (CPU)"
        lines.append(
            f"| {r['device']} | {r['model']} | {r['batch']} | {r['ours_img_s']:.0f} | {r['one_batch_img_s']:.0f} | "
            f"{r['ours_img_s'] / r['one_batch_img_s']:.0%} | {r['tutorial_pipeline_img_s']:.0f} | "
            f"{r['ours_img_s'] / r['tutorial_pipeline_img_s']:.2f}x | {r['peak_mb']:.0f} | {mfu_text} |"
        )
    return lines + [
        "",
        "Tutorial pipeline: torchvision RandomCrop + flip + ToTensor + Normalize on PIL images in "
        f"{result['sizes']['baseline_workers']} DataLoader workers, the same model and optimiser. CPU peak memory "
        "is the process's peak RSS so far (cumulative); GPU is max_memory_allocated per row.",
    ]


def compiled(rows: list[dict]) -> list[str]:
    if not rows:
        return []
    lines = [
        "",
        "## torch.compile, bf16, channels_last, cudnn.benchmark (img/s and MFU by batch size)",
        "",
        "| device | model | batch | compile (first two steps) s | ours | one batch repeated | ours / one batch "
        "| peak memory MB | MFU |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        mode = r.get("compile_mode", "default")  # results written before the mode was a key: the default
        model = r["model"] if mode == "default" else f"{r['model']} ({mode})"
        lines.append(
            f"| {r['device']} | {model} | {r['batch']} | {r['first_two_steps_s']:.1f} | {r['ours_img_s']:.0f} | "
            f"{r['one_batch_img_s']:.0f} | {r['ours_img_s'] / r['one_batch_img_s']:.0%} | {r['peak_mb']:.0f} | "
            f"{r.get('mfu', float('nan')):.1%} |"
        )
    return lines


def data_path(rows: list[dict]) -> list[str]:
    lines = [
        "",
        "## Data path alone (normalised batches on the device)",
        "",
        "| device | loader | img/s | vs ours |",
        "| --- | --- | --- | --- |",
    ]
    for r in rows:
        ours = next(o["img_s"] for o in rows if o["device"] == r["device"] and "ours" in o["loader"])
        lines.append(f"| {r['device']} | {r['loader']} | {r['img_s']:.0f} | {ours / r['img_s']:.1f}x |")
    return lines


def ddp(rows: list[dict]) -> list[str]:
    lines = [
        "",
        "## DDP overhead (one pre-made batch, same global batch)",
        "",
        "| device | model | global batch | bare step ms | DDP world size 1 ms | overhead | ddp.comm_hook=none ms, "
        "overhead | N processes | step ms | speed-up N vs 1 | stop agreement ms | compiled: first two steps s, DDP "
        "step ms |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        n = "n/a | | "
        if "processes" in r:
            n = f"{r['processes']} | {r['ddpN_step_s'] * 1e3:.1f} | {r['speedup_N_vs_1']:.2f}x"
        torchs = "-"  # (rows of a bench before 2026-11-26 have no such figure)
        if "ddp1_torch_reduction_step_s" in r:
            torchs = f"{r['ddp1_torch_reduction_step_s'] * 1e3:.1f}, {r['ddp1_torch_reduction_overhead']:+.1%}"
        c = "not measured"
        if "ddp1_compiled_step_s" in r:
            c = f"{r['compiled_first_two_steps_s']:.1f} s, {r['ddp1_compiled_step_s'] * 1e3:.1f} ms"
        lines.append(
            f"| {r['device']} | {r['model']} | {r['global_batch']} | {r['bare_step_s'] * 1e3:.1f} | "
            f"{r['ddp1_step_s'] * 1e3:.1f} | {r['ddp1_overhead']:+.1%} | {torchs} | {n} | "
            f"{r['stop_agreement_s'] * 1e3:.3f} | {c} |"
        )
    compiled_rows = [r for r in rows if "compiled_variants" in r]
    if compiled_rows:
        lines += [
            "",
            "Compiled DDP at world size 1, each way to combine them (bench/harness.py COMPILED_DDP), each compiled "
            "afresh and timed in turns with eager DDP (the bare model: eager, from the table above; cuda_graphs: "
            "torch.compile's reduce-overhead):",
            "",
            "| model | global batch | variant | first two steps s | step ms | eager DDP / it | eager bare / it "
            "| graphs without CUDA graphs |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for r in compiled_rows:
            for name, v in r["compiled_variants"].items():
                if "compiled_autograd_captures" in v:  # a variant void if its backward was not compiled autograd's
                    name += f" ({v['reducer']} reducer, {v['compiled_autograd_captures']} backwards compiled)"
                head = f"| {r['model']} | {r['global_batch']} | {name} |"
                if "error" in v:
                    lines.append(f"{head} failed: {v['error'].replace('|', '/')} | | | | |")
                    continue
                bare = f"{v['vs_bare']:.2f}x" if "vs_bare" in v else "-"
                lines.append(f"{head} {v['first_two_steps_s']:.1f} | {v['step_s'] * 1e3:.2f} | {v['vs_eager']:.2f}x | "
                             f"{bare} | {v.get('cudagraph_skips', '-')} |")  # fmt: skip
    return lines


def time_to_accuracy(t: dict) -> list[str]:
    lines = [
        "",
        f"## Time to accuracy on the CPU ({t['data']})",
        "",
        "| pipeline | epoch | seconds | test accuracy |",
        "| --- | --- | --- | --- |",
    ]
    for name, key in (("configs/fast.yaml (ours)", "fast_recipe"), ("tutorial pipeline", "tutorial_pipeline")):
        lines += [f"| {name} | {o['epoch']} | {o['seconds']:.0f} | {o['test_acc']:.1%} |" for o in t[key]]
    reached = t["fast_seconds_to_tutorial_best"]
    verdict = (
        f"the fast recipe reached it in {reached:.0f} s."
        if reached is not None
        else "the fast recipe did not reach it."
    )
    best, took = t["tutorial_best_acc"], t["tutorial_seconds_to_its_best"]
    return lines + ["", f"The tutorial pipeline's best, {best:.1%}, took it {took:.0f} s; {verdict}"]
