import pytest
import torch

from ray_specdec.config import TreeConfig
from ray_specdec.speculation.tree import build_tree


def test_three_node_tree_by_hand():
    tree = build_tree([(0,), (1,), (0, 0)])
    assert tree.parents.tolist() == [-1, 0, 0, 1]
    assert tree.depths.tolist() == [0, 1, 1, 2]
    assert tree.attn_mask.int().tolist() == [
        [1, 0, 0, 0],
        [1, 1, 0, 0],
        [1, 0, 1, 0],
        [1, 1, 0, 1],
    ]
    assert tree.position_ids(10).tolist() == [10, 11, 11, 12]
    assert tree.leaf_paths == ((0, 2), (0, 1, 3))
    assert tree.children == ((1, 2), (3,), (), ())
    assert tree.depth_starts == (0, 1, 3, 4)
    assert tree.num_nodes == 3 and tree.depth == 2


def test_paths_in_any_order_give_bfs_rows():
    assert build_tree([(0, 0), (1,), (0,)]).paths == ((0,), (1,), (0, 0))


@pytest.mark.parametrize("paths", [[(0,), (0,)], [(1,)], [(0, 0)], [(0,), (2,), (1, 0)], [()]])
def test_invalid_trees_are_rejected(paths):
    with pytest.raises(ValueError):
        build_tree(paths)


@pytest.mark.parametrize(
    "branching, rows",
    [((1, 1, 1, 1), (1, 1, 1, 1)), ((3, 2, 2, 1, 1), (3, 6, 12, 12, 12)), ((4,), (4,)), ((2, 3), (2, 6))],
)
def test_config_tree_shapes(branching, rows):
    config = TreeConfig(branching)
    tree = build_tree(config.index_paths())
    assert config.rows_per_depth == rows
    assert tree.num_nodes == config.num_nodes == sum(rows)
    assert [tree.depth_starts[d + 1] - tree.depth_starts[d] for d in range(1, config.depth + 1)] == list(rows)
    for d in range(1, config.depth + 1):
        parents = tree.parents_at_depth(d)
        # rows at depth d are grouped by parent, N_d children each, parents in order
        assert parents.tolist() == torch.arange(tree.depth_starts[d] - tree.depth_starts[d - 1]).repeat_interleave(
            branching[d - 1]
        ).tolist()
    # every node sees exactly its ancestors and itself
    assert tree.attn_mask.sum(1).tolist() == (tree.depths + 1).tolist()
    assert len(tree.leaf_paths) == rows[-1]


def test_tree_config_parse_and_errors():
    assert TreeConfig.parse("3,2,2,1,1").branching == (3, 2, 2, 1, 1)
    assert TreeConfig.parse("(2, 1)").branching == (2, 1)
    assert TreeConfig.parse("none").branching == ()
    assert str(TreeConfig((3, 2))) == "3,2"
    assert TreeConfig((3, 2, 1)).truncated(2).branching == (3, 2)
    for bad in ["a,b", "0,1", "-1"]:
        with pytest.raises(ValueError):
            TreeConfig.parse(bad)
    with pytest.raises(ValueError):
        TreeConfig((8, 8, 8, 8))


def test_default_tree_per_device():
    from ray_specdec.config import CPU_DEFAULT_TREE, DEFAULT_TREE, default_tree

    assert default_tree("cpu") == CPU_DEFAULT_TREE == TreeConfig((1, 1, 1))
    assert default_tree("cuda") == default_tree("cuda:1") == DEFAULT_TREE == TreeConfig((2, 2, 1, 1))
