"""summary.md: every drafter, the best per column in bold, and the backend mismatch impossible to miss."""

from __future__ import annotations

from tests.support.report_inputs import table_line


def test_markdown_has_every_drafter_and_the_bold_best(out):
    markdown = (out / "summary.md").read_text()
    main = "## tau, z-lab mean"
    first, second = table_line(markdown, main, "step-1000"), table_line(markdown, main, "step-2000")
    assert "step-1000 (reference)" in first and "| 1000 |" in first and "| 2000 |" in second
    assert "**5.25** <sub>[5.00, 5.50]</sub>" in second  # best on gsm8k
    assert "**3.90** <sub>[3.70, 4.10]</sub>" in first  # best on humaneval
    assert "| 4.10 <sub>[3.90, 4.30]</sub>" in first and "3.50 <sub>[3.20, 3.80]</sub> ⚠️" in second
    assert "gsm8k<br>chain-B4 | gsm8k<br>ddtree-8 | humaneval<br>chain-B4 | humaneval<br>ddtree-8 |" in markdown
    assert "**6.25** <sub>[6.00, 6.50]</sub>" in second  # DDTree-8 best on gsm8k, CI shifted by 1
    shorter = table_line(markdown, "## Chain drafting with shorter blocks", "step-2000")
    assert "chain-B2" not in markdown.split(main, 1)[1].split("\n## ", 1)[0]
    assert "| **2.62** <sub>[5.00, 5.50]</sub>" in shorter  # 5.25 / 2, the CI kept as written
    assert "**5.50** <sub>[5.20, 5.80]</sub>" in table_line(markdown, "## tau, token-weighted", "step-2000")
    assert "128.0%" in table_line(markdown, "relative to the reference", "step-2000")


def test_markdown_flags_the_backend_mismatch_loudly(out):
    markdown = (out / "summary.md").read_text()
    warnings = markdown.split("## ⚠️ Warnings", 1)[1].split("## tau", 1)[0]
    assert "**Backend mismatch**: step-2000 on humaneval" in warnings and "`torch`" in warnings
    diagnostics = markdown.split("## Diagnostics", 1)[1]
    row = next(line for line in diagnostics.splitlines() if line.startswith("| step-2000 | humaneval"))
    assert "**⚠️ YES (allowed)**" in row and "99.75%" in row and "7 (not in the completions file)" in row
    assert "1, 3" in row and "sha256 abababababab" in row
    assert sum("⚠️ YES" in line for line in diagnostics.splitlines()) == 1
