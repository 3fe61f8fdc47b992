"""The ring all-reduce stepper of lesson 04: its model of the ring, and its widget."""

from __future__ import annotations

import pytest
import torch

from ddp_magics.lessons import RingStepper, ring_allreduce_states
from ddp_magics.live_view import WIDGET_MIMETYPE


def inputs_for(world_size: int, length: int) -> list[list[float]]:
    return [[float(100 * rank + i) for i in range(length)] for rank in range(world_size)]


@pytest.mark.parametrize(("world_size", "length"), [(2, 2), (2, 5), (3, 3), (4, 4), (4, 11), (5, 17)])
def test_every_rank_ends_with_the_sum(world_size, length):
    inputs = inputs_for(world_size, length)
    states = ring_allreduce_states(inputs)
    expected = [sum(column) for column in zip(*inputs)]
    assert len(states) == 1 + 2 * (world_size - 1)
    assert RingStepper(inputs).result == [expected] * world_size
    assert all(sources == frozenset(range(world_size)) for row in states[-1].sources for sources in row)


@pytest.mark.parametrize(("world_size", "length"), [(3, 7), (4, 4), (5, 12)])
def test_chunks_are_cut_like_tensor_split(world_size, length):
    (start, *_) = ring_allreduce_states(inputs_for(world_size, length))
    expected = [part.tolist() for part in torch.arange(float(length)).tensor_split(world_size)]
    assert [list(chunk) for chunk in start.values[0]] == expected


@pytest.mark.parametrize("world_size", [2, 3, 4, 6])
def test_reduce_scatter_leaves_each_rank_one_finished_chunk(world_size):
    states = ring_allreduce_states(inputs_for(world_size, world_size))
    after_reduce_scatter = states[world_size - 1]
    for rank in range(world_size):
        finished = [
            chunk
            for chunk, sources in enumerate(after_reduce_scatter.sources[rank])
            if sources == frozenset(range(world_size))
        ]
        assert finished == [(rank + 1) % world_size]


@pytest.mark.parametrize("world_size", [2, 3, 5])
def test_every_step_sends_one_chunk_to_the_right_neighbour(world_size):
    states = ring_allreduce_states(inputs_for(world_size, 2 * world_size))
    assert states[0].transfers == ()
    for state in states[1:]:
        assert sorted((t.src, t.dst) for t in state.transfers) == [
            (rank, (rank + 1) % world_size) for rank in range(world_size)
        ]
    phases = [state.phase for state in states[1:]]
    assert phases == ["reduce-scatter"] * (world_size - 1) + ["all-gather"] * (world_size - 1)


def test_reduce_scatter_adds_and_all_gather_copies():
    states = ring_allreduce_states([[1.0, 2.0], [10.0, 20.0]])
    # step 1: rank 0 sends chunk 0 to rank 1 (which adds), rank 1 sends chunk 1 to rank 0
    assert states[1].values == (((1.0,), (22.0,)), ((11.0,), (20.0,)))
    # step 2: the finished chunks are copied over
    assert states[2].values == (((11.0,), (22.0,)), ((11.0,), (22.0,)))


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        ([[1.0, 2.0]], "at least 2 ranks"),
        ([[1.0, 2.0], [1.0]], "same length"),
        ([[1.0], [2.0], [3.0]], "1 elements cannot be cut into 3"),
    ],
)
def test_bad_inputs_are_one_line_errors(inputs, message):
    with pytest.raises(ValueError, match=message):
        RingStepper(inputs)


def test_text_lists_the_transfers_and_marks_what_arrived():
    stepper = RingStepper([[1.0, 2.0], [10.0, 20.0]])
    text = stepper.text(1)
    assert text.splitlines()[0].startswith("step 1 of 2, reduce-scatter step 1 of 1")
    assert "rank 0 -> rank 1: chunk 0" in text and "rank 1 -> rank 0: chunk 1" in text
    rank_0_row = next(line for line in text.splitlines() if line.strip().startswith("rank 0  "))
    assert "[1.0] (r0)" in rank_0_row and "[22.0] (all ranks) *" in rank_0_row
    assert "*" not in stepper.text(0)


def test_widget_moves_through_the_steps():
    stepper = RingStepper(inputs_for(3, 6))
    bundle = stepper._repr_mimebundle_()
    assert bundle["text/plain"] == stepper.text(0)
    assert bundle[WIDGET_MIMETYPE]["model_id"] == stepper.widget().model_id
    controls, pages = stepper.widget().children
    play, previous, following, slider = controls.children
    assert (slider.max, play.max) == (4, 4)
    assert [page.value for page in pages.children] == [stepper.html(step) for step in range(5)]
    assert pages.selected_index == 0

    following.click()
    following.click()
    assert stepper.step == 2 and pages.selected_index == 2
    previous.click()
    assert stepper.step == 1 and pages.selected_index == 1
    stepper.show(4)
    assert slider.value == 4 and pages.selected_index == 4
    following.click()  # already at the last step: stays there
    assert stepper.step == 4
    assert stepper._repr_mimebundle_()["text/plain"] == stepper.text(4)
    with pytest.raises(ValueError, match="steps 0 to 4"):
        stepper.show(5)


def test_html_shades_received_chunks_and_bolds_finished_ones():
    stepper = RingStepper(inputs_for(2, 2))
    start, reduced = stepper.html(0), stepper.html(1)
    assert "font-weight:bold" not in start and "background:#e3f2e1" not in start
    assert reduced.count("background:#e3f2e1") == 2 and reduced.count("font-weight:bold") == 2
    assert stepper.html(2).count("background:#e1ecf7") == 2


@pytest.mark.parametrize("world_size", [2, 5, 8, 16])
def test_rank_columns_are_one_grid_of_equal_widths(world_size):
    """The rank blocks are columns of one width (the longest line's), as many to a row as fit:
    they line up from row to row (a flex row let 5 narrow columns sit above 3 wider ones)."""
    import re

    from ddp_magics.cluster.records import RankOutput
    from ddp_magics.output import render

    outputs = [RankOutput(rank, stdout=f"rank {rank}: " + "x" * rank + "\n") for rank in range(world_size)]
    [blocks] = render(outputs)
    page = blocks._repr_html_()
    [width] = re.findall(r"repeat\(auto-fill,minmax\(min\((\d+)ch,100%\),1fr\)\)", page)
    longest = max(len(line) for block in blocks.blocks for line in block.text().splitlines())
    assert int(width) == max(longest + 1, 14)
    assert page.count('<div style="min-width:0;overflow-x:auto">') == world_size
    assert "flex" not in page


def test_the_live_view_shows_a_progress_bars_latest_frame():
    """tqdm redraws its bar with carriage returns: the running cell's view shows the last frame,
    as a terminal would, not every frame on a line of its own."""
    from ddp_magics.cluster.records import RankOutput
    from ddp_magics.output import live_html

    frames = "".join(f"\rLoading: {percent}%" for percent in (0, 40, 80)) + "\nnext line\n"
    page = live_html([RankOutput(0, stderr=frames)], {0}, 2.0, tail_lines=10)
    assert "Loading: 80%\nnext line" in page and "40%" not in page
