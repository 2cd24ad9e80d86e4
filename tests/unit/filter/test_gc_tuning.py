"""The filter's collector settings once serving (plane.tune_gc)."""

from __future__ import annotations

import gc

from appliance.filter import plane


def test_start_up_is_frozen_and_full_collections_are_made_rarer():
    before = gc.get_threshold()
    try:
        plane.tune_gc()
        assert gc.get_threshold() == plane.GC_THRESHOLDS
        assert gc.get_freeze_count() > 0
        young, _, full = plane.GC_THRESHOLDS
        assert young == before[0] and full > before[2]  # young collections stay as small
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
