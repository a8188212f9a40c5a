"""Paper-style figures and a markdown summary, regenerated from stored results only.

Each page function (specee/report_pages/) takes the loaded results and returns
``(figure, markdown)`` or raises :class:`Skip` with the reason its inputs are missing; the report
keeps going without it. This module assembles them: the cover, the pages in order, the PDF and
the markdown summary.
"""
from __future__ import annotations

from datetime import date
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import seaborn as sns  # noqa: E402
from matplotlib.backends.backend_pdf import PdfPages  # noqa: E402

from specee.errors import SpeceeError  # noqa: E402
from specee.report_pages.catalogue import Skip  # noqa: E402
from specee.report_pages.claims import fig_accuracy, fig_paper_beside, fig_verdicts  # noqa: E402
from specee.report_pages.exits import fig_context_similarity, fig_exit_distribution, fig_potential  # noqa: E402
from specee.report_pages.speed import (fig_cost_model, fig_exit_vs_oracle, fig_gpu_paths, fig_overhead,  # noqa: E402
                                       fig_runtime, fig_speedup_per_category, fig_staircase, fig_which_method)

__all__ = ["FIGURES", "Skip", "build_report"]


FIGURES = [
    ("Speedup per dataset and method", fig_speedup_per_category),
    ("Which method, here?", fig_which_method),
    ("Ablation staircase", fig_staircase),
    ("Measured against modelled speedup", fig_cost_model),
    ("Where a token's time goes on a GPU, per path", fig_gpu_paths),
    ("Exit-layer distribution", fig_exit_distribution),
    ("Context similarity", fig_context_similarity),
    ("Predictor count and overhead", fig_overhead),
    ("Exits against the oracle", fig_exit_vs_oracle),
    ("Accuracy", fig_accuracy),
    ("Verdicts on the paper's claims", fig_verdicts),
    ("Beside the paper's own figures", fig_paper_beside),
    ("Will SpecEE pay off here? (potential)", fig_potential),
    ("Eager vs compiled runtime", fig_runtime),
]


def build_report(docs: list[dict], out_dir: Path, source: str) -> dict:
    """Write report.pdf and summary.md into ``out_dir``; return pages made and skipped."""
    out_dir.mkdir(parents=True, exist_ok=True)
    sns.set_theme(style="whitegrid", context="paper")
    made, skipped, md_parts = [], [], []
    pdf_tmp, md_tmp = out_dir / ".report.pdf.tmp", out_dir / ".summary.md.tmp"
    with PdfPages(pdf_tmp) as pdf:
        figures = []
        for title, fn in FIGURES:
            try:
                fig, md = fn(docs)
            except Skip as why:
                skipped.append((title, str(why)))
                continue
            except (KeyError, TypeError, ValueError, ZeroDivisionError) as err:
                pdf_tmp.unlink(missing_ok=True)
                raise SpeceeError(f"report page {title!r} cannot be drawn from these results "
                                  f"({type(err).__name__}: {err}); the report in {out_dir} was not "
                                  "updated") from None
            figures.append((title, fig))
            md_parts.append(f"## {title}\n\n{md}")
        cover = plt.figure(figsize=(8.5, 11))
        lines = [f"specee report — {source}", f"generated {date.today().isoformat()} from {len(docs)} result files",
                 "", "Pages:"] + [f"  {i + 2}. {t}" for i, (t, _) in enumerate(figures)] + \
                ["", "Skipped:"] + [f"  {t}: {why}" for t, why in skipped or [("none", "")]]
        cover.text(0.08, 0.92, "\n".join(lines), va="top", family="monospace", fontsize=9)
        pdf.savefig(cover)
        plt.close(cover)
        for title, fig in figures:
            fig.tight_layout()
            pdf.savefig(fig)
            plt.close(fig)
            made.append(title)
    md = [f"# specee report\n\nSource: `{source}` · {len(docs)} result files · generated {date.today().isoformat()}\n"]
    md += md_parts
    if skipped:
        md.append("## Skipped figures\n\n" + "".join(f"- {t}: {why}\n" for t, why in skipped))
    md_tmp.write_text("\n".join(md))
    pdf_tmp.replace(out_dir / "report.pdf")
    md_tmp.replace(out_dir / "summary.md")
    return {"pages": ["cover", *made], "skipped": skipped, "pdf": str(out_dir / "report.pdf"),
            "markdown": str(out_dir / "summary.md")}
