"""Tables and curves of `bench_quality.py` results: one markdown table and one plot panel per corpus.

Each table compares every row with the synchronous data-parallel row ("vs sync") and with the
first plain DiLoCo row ("vs plain"); bytes are as the shepherd measured them, except the sync
row's, which are what an all-reduce of float32 gradients would send (marked *).

    python benchmarks/quality_report.py DIR/*/quality.json --out DIR
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path

ORDER = ("sync", "plain", "streaming", "averaged", "single")


@dataclass
class Result:
    label: str
    workers: int
    inner_steps: int
    rounds: int
    tokens: int
    final_eval_loss: float
    bytes_communicated: int
    train_seconds: float
    curve: list[tuple[int, float]]  # (training tokens so far, held-out loss)
    corpus: str = "embedded"
    row: str = ""
    model: str = ""
    bytes_measured: bool = True  # False: computed (the sync row's all-reduce)
    finished: bool = True  # False: a partial.json of a run cut short
    planned_rounds: int = 0
    eval_windows: int = 0  # held-out sequences each evaluation averages over
    k: int = 4  # data-parallel width: DiLoCo's workers, the workers sync's batch stands for


def _versus(result: Result, reference: Result | None) -> str:
    if reference is None or not reference.finished or not result.finished:
        return "-"
    return f"{100 * (result.final_eval_loss / reference.final_eval_loss - 1):+.2f}%"


def table(results: list[Result]) -> str:
    """Markdown table of one corpus' rows, with ratios against sync and plain DiLoCo."""
    sync = next((r for r in results if r.row == "sync"), None)
    plain = next((r for r in results if r.row == "plain"), None)
    lines = [
        "| run | rounds | tokens | final eval loss | vs sync | vs plain | bytes | "
        "fewer bytes than sync | train time |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        rounds = f"{r.rounds}" if r.finished else f"{r.rounds}/{r.planned_rounds} (cut short)"
        fewer = (
            f"{sync.bytes_communicated / r.bytes_communicated:,.0f}x"
            if sync and r.bytes_communicated and r.workers > 1
            else "-"
        )
        star = "" if r.bytes_measured else "*"
        lines.append(
            f"| {r.label} | {rounds} | {r.tokens:,} | {r.final_eval_loss:.4f} | "
            f"{_versus(r, sync)} | {_versus(r, plain)} | "
            f"{r.bytes_communicated / 1e6:,.1f} MB{star} | {fewer} | {r.train_seconds:.0f} s |"
        )
    windows = {r.eval_windows for r in results}
    if len(windows) > 1:
        lines.append(
            f"\n**Rows were evaluated on different held-out windows** ({sorted(windows)}): "
            "their losses are not comparable; give the corpus more held-out text or pass "
            "fewer --eval-batches."
        )
    if sync is not None:
        lines.append(
            "\n\\* sync DP runs as one worker with a k-times batch (all-reduce of gradients with "
            "one AdamW is exactly that); its bytes are what k workers would exchange for it, "
            "each sending its float32 gradient and receiving the average every step "
            "(2 x 4 B x parameters x k per step; a ring all-reduce sends 2(k-1)/k of that). "
            "Other rows: bytes the shepherd counted on the wire, both directions."
        )
    return "\n".join(lines)


def by_corpus(results: list[Result]) -> dict[str, list[Result]]:
    """Results grouped by corpus, model and k (a table compares like with like), in row order."""
    groups: dict[str, list[Result]] = {}
    for r in results:
        groups.setdefault(f"{r.corpus}: {r.model}, k={r.k}", []).append(r)
    for group in groups.values():
        group.sort(key=lambda r: (ORDER.index(r.row) if r.row in ORDER else len(ORDER), r.label))
    return groups


def plot(groups: dict[str, list[Result]], path: Path) -> bool:
    """Held-out loss against training tokens, one panel per corpus, into `path` (PNG)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'): no plot", flush=True)
        return False
    figure, panels = plt.subplots(1, len(groups), figsize=(7 * len(groups), 4.5), squeeze=False)
    for axes, (key, results) in zip(panels[0], groups.items(), strict=True):
        for r in results:
            if not r.curve:
                continue
            tokens, losses = zip(*r.curve, strict=True)
            axes.plot([t / 1e6 for t in tokens], losses, marker=".", label=r.label)
        finals = [r.final_eval_loss for r in results if math.isfinite(r.final_eval_loss)]
        if finals:  # the first points (loss ~5.5) would flatten the curves where they differ
            axes.set_ylim(top=min(4.0, 1.5 * max(finals)))
        corpus, _, setup = key.rpartition(": ")
        name, _, archive = corpus.partition(":")
        title = f"{name} ({Path(archive).name}), {setup}" if archive else f"{corpus}, {setup}"
        axes.set(xlabel="training tokens (millions)", ylabel="held-out loss", title=title)
        axes.grid(alpha=0.3)
        axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    return True


def report(results: list[Result], out: Path) -> str:
    """Write quality_table.md and quality.png into `out`; return (and print) the tables."""
    groups = by_corpus(results)
    text = "\n\n".join(f"### {key}\n\n{table(group)}" for key, group in groups.items())
    (out / "quality_table.md").write_text(text + "\n")
    print(text, flush=True)
    if groups:
        plot(groups, out / "quality.png")
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, nargs="+", help="quality.json / partial.json files")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results = [Result(**r) for path in args.results for r in json.loads(path.read_text())]
    (args.out / "quality.json").write_text(json.dumps([vars(r) for r in results], indent=1))
    report(results, args.out)


if __name__ == "__main__":
    main()
