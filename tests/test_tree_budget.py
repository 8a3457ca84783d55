"""The tree budget comes from measurements: the cost curve and the heads' acceptance."""
from __future__ import annotations

import torch

from gumiho_core import Engine, TreeSettings, new_heads
from gumiho_core.draft_tree import DraftTree
from gumiho_core.tree_budget import accepted_length, choose_tree, format_budget, measure_cost_curve
from tiny import tiny_target


def test_accepted_length_of_sub_trees():
    # root -> a (score -0.1) -> b (-0.5) -> c (-2.0); root -> x (-0.3)
    tree = DraftTree(torch.tensor([0, 5, 6, 7, 8]), [-1, 0, 1, 2, 0], [0, 1, 2, 3, 1],
                     ["root", "serial", "serial", "mlp", "serial"], [0.0, -0.1, -0.5, -2.0, -0.3])
    path = [0, 1, 2, 3]
    assert accepted_length(tree, path, budget=5, depth=7) == 3
    assert accepted_length(tree, path, budget=4, depth=7) == 2  # c is the worst node: dropped
    assert accepted_length(tree, path, budget=2, depth=7) == 1
    assert accepted_length(tree, path, budget=5, depth=1) == 1


def test_choose_tree_measures_and_caches(tmp_path, monkeypatch):
    monkeypatch.setenv("GUMIHO_CACHE", str(tmp_path))
    target = tiny_target(seed=0, eos=False)
    engine = Engine(target, new_heads(target))
    curve = measure_cost_curve(target, sizes=(1, 4, 8), reps=2)
    assert set(curve) == {1, 4, 8} and all(ms > 0 for ms in curve.values())
    tree, report = choose_tree(engine)
    assert isinstance(tree, TreeSettings) and tree.total_tokens in report["cost_curve_ms"]
    tree.validate()
    assert report["best"]["tokens_per_s"] == max(c["tokens_per_s"] for c in report["top"])
    assert "chosen tree" in format_budget(report)
    # Drafting is timed per top_k and depth, and one-token drafts are candidates.
    assert {"2/1", "2/7", "6/3"} <= set(report["draft_ms"]) and all(ms > 0 for ms in report["draft_ms"].values())
    again, _ = choose_tree(engine)  # from the cache, no new measurement
    assert again == tree
    assert list((tmp_path / "tree_budget").glob("choice-*.json"))
