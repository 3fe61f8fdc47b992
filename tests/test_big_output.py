"""A cell whose value is huge on a rank shows a bounded tail of it (printed floods: test_hardening)."""

from __future__ import annotations

from ddp_magics.output import MAX_SHOWN_CHARS
from tests.conftest import run_cell, shown_text


def test_a_value_of_50_mb_on_a_rank_shows_a_bounded_tail(ip, healthy):
    captured, error = run_cell(ip, "", "'y' * 50_000_000 if rank == 1 else 'small'")
    assert error is None
    shown = shown_text(captured)
    assert len(shown) < MAX_SHOWN_CHARS + 1000
    dropped = len(repr("y" * 50_000_000)) - MAX_SHOWN_CHARS
    note = f"... {dropped:,} earlier characters not shown ..."
    assert shown.startswith(f"[rank 0]\n'small'\n[rank 1]\n{note}\n")
    assert shown.endswith("yyy'")
