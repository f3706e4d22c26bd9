"""``meshnet up``'s layout: serving ranges that tile the model, then spares that cover all but the head."""

from __future__ import annotations

import pytest

from meshnet.cli.up import swarm_layout
from meshnet.layers import split_layers


def test_split_layers_tiles_the_model_evenly():
    assert [str(r) for r in split_layers(30, 3)] == ["0:10", "10:20", "20:30"]
    assert [str(r) for r in split_layers(10, 3)] == ["0:4", "4:7", "7:10"]
    assert [str(r) for r in split_layers(30, 1)] == ["0:30"]
    with pytest.raises(ValueError, match=r"--nodes must be within 1\.\.30"):
        split_layers(30, 31)


def test_spares_cover_every_layer_but_the_heads():
    assert [str(r) for r in swarm_layout(30, 3, 0)] == ["0:10", "10:20", "20:30"]
    assert [str(r) for r in swarm_layout(30, 4, 1)] == ["0:10", "10:20", "20:30", "10:30"]
    assert [str(r) for r in swarm_layout(30, 4, 2)] == ["0:15", "15:30", "15:30", "15:30"]
    assert [str(r) for r in swarm_layout(30, 1, 0)] == ["0:30"]


def test_impossible_spare_layouts_say_why():
    with pytest.raises(ValueError, match=r"--spares must be within 0\.\.2"):
        swarm_layout(30, 3, 3)
    with pytest.raises(ValueError, match="a spare needs at least 2 serving nodes"):
        swarm_layout(30, 2, 1)


def test_split_layers_picks_the_allowed_cuts_nearest_to_an_even_split():
    assert [str(r) for r in split_layers(9, 3, [0, 3, 6])] == ["0:3", "3:6", "6:9"]
    assert [str(r) for r in split_layers(48, 3, list(range(0, 48, 4)))] == ["0:16", "16:32", "32:48"]
    assert [str(r) for r in split_layers(30, 4, list(range(0, 30, 4)))] == ["0:8", "8:16", "16:24", "24:30"]
    assert [str(r) for r in split_layers(6, 3, [0, 1, 2, 4])] == ["0:2", "2:4", "4:6"]
    assert [str(r) for r in split_layers(10, 3, [0, 8, 9])] == ["0:8", "8:9", "9:10"]
    with pytest.raises(ValueError, match=r"cut only before layers \[4\]: at most 2 nodes, not 3"):
        split_layers(8, 3, [0, 4])
