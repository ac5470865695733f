"""The decode loop's cache layers (workers/sampling/kv_cache.py): what a GrowingLayer holds equals
what transformers' DynamicLayer holds after the same updates, while a step writes in place."""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer

from queue_tinker.workers.sampling.kv_cache import MIN_SPARE, GrowingLayer

ROWS, HEADS, DIM = 3, 2, 4


def states(columns: int, rows: int = ROWS, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    draws = torch.Generator().manual_seed(seed)
    shape = (rows, HEADS, columns, DIM)
    return torch.randn(shape, generator=draws), torch.randn(shape, generator=draws)


def reference(keys: torch.Tensor, values: torch.Tensor) -> DynamicLayer:
    layer = DynamicLayer()
    layer.update(keys, values)
    return layer


def storage(layer: GrowingLayer) -> int:
    keys, _ = layer.states()
    return keys.untyped_storage().data_ptr()


def assert_same_states(layer: GrowingLayer, expected: DynamicLayer) -> None:
    keys, values = layer.states()
    assert expected.keys is not None and expected.values is not None
    torch.testing.assert_close(keys, expected.keys, rtol=0, atol=0)
    torch.testing.assert_close(values, expected.values, rtol=0, atol=0)
    assert layer.get_seq_length() == expected.get_seq_length()


def test_steps_within_the_room_write_in_place_and_equal_concatenation() -> None:
    """Each update appends its column to the same buffers, which hold exactly the room."""
    layer, expected = GrowingLayer.holding(*states(5), room=6), reference(*states(5))
    assert layer.capacity == 5 + 6  # the room bounds the spare columns
    place = storage(layer)
    for step in range(6):
        new = states(1, seed=step + 1)
        returned = layer.update(*new)
        expected.update(*new)
        assert returned == layer.states()
        assert_same_states(layer, expected)
        assert storage(layer) == place
    assert layer.room == 0


def test_past_its_room_a_layer_grows_by_a_quarter_of_its_length() -> None:
    """A prompt of 400 columns with room for 1 more: the second step re-makes the buffers
    with a quarter of the length in spare columns, and the states go on equal."""
    layer, expected = GrowingLayer.holding(*states(400), room=1), reference(*states(400))
    for step in range(3):
        new = states(1, seed=step + 1)
        layer.update(*new)
        expected.update(*new)
    assert_same_states(layer, expected)
    assert MIN_SPARE < 401 // 4
    assert layer.capacity == 401 + 401 // 4


def test_rows_leave_and_unused_columns_drop_as_indexing_would() -> None:
    """batch_select_indices keeps rows in the order given, drop_left forgets leading columns;
    the next step still writes in place."""
    layer = GrowingLayer.holding(*states(6), room=10)
    keys, values = states(6)
    layer.batch_select_indices(torch.tensor([2, 0]))
    layer.drop_left(2)
    place = storage(layer)
    new = states(1, rows=2, seed=9)
    layer.update(*new)
    expected = reference(keys[[2, 0], :, 2:], values[[2, 0], :, 2:])
    expected.update(*new)
    assert_same_states(layer, expected)
    assert storage(layer) == place


def test_joined_layers_are_left_padded_with_zeros() -> None:
    """Rows joining: the narrower layer's rows get zero columns on the left (finite under the
    mask), and the room is the larger one."""
    first, second = (
        GrowingLayer.holding(*states(3), room=4),
        GrowingLayer.holding(*states(5, rows=2, seed=1), room=7),
    )
    joined = GrowingLayer.joined(first, second, width=5)
    keys, values = joined.states()
    assert keys.shape == (ROWS + 2, HEADS, 5, DIM) and joined.room == 7
    short_keys, _ = states(3)
    torch.testing.assert_close(keys[:ROWS, :, 2:], short_keys, rtol=0, atol=0)
    assert not keys[:ROWS, :, :2].any() and not values[:ROWS, :, :2].any()
    long_keys, long_values = states(5, rows=2, seed=1)
    torch.testing.assert_close(keys[ROWS:], long_keys, rtol=0, atol=0)
    torch.testing.assert_close(values[ROWS:], long_values, rtol=0, atol=0)


def test_states_replaced_from_outside_are_taken_in_at_the_next_update() -> None:
    """transformers' own cache methods assign keys / values: the layer copies them into
    fresh buffers instead of writing after stale ones."""
    layer = GrowingLayer.holding(*states(4), room=8)
    replacement = states(2, seed=5)
    layer.keys, layer.values = replacement
    new = states(1, seed=6)
    layer.update(*new)
    expected = reference(*replacement)
    expected.update(*new)
    assert_same_states(layer, expected)
