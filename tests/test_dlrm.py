"""The DLRM demo: its data (seeded, Zipf-shaped, with a signal a model can find), its AUC, its
model, the hybrid strategy (tables on ps shards, dense gradients by ring), and the demo end to end."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from zmqflow.errors import InvalidArgument
from zmqflow.examples.dlrm.data import DENSE_FEATURES, DataConfig, make_data, roc_auc

from .conftest import ZMQFLOW

SMALL = DataConfig(samples=40_000, held_out=10_000, vocab_sizes=(20_000, 5_000, 1_000, 200, 50, 10))


def test_the_data_is_the_same_for_the_same_seed_and_differs_for_another():
    a_train, a_test = make_data(SMALL)
    b_train, b_test = make_data(SMALL)
    for a, b in ((a_train, b_train), (a_test, b_test)):
        np.testing.assert_array_equal(a.dense, b.dense)
        np.testing.assert_array_equal(a.sparse, b.sparse)
        np.testing.assert_array_equal(a.labels, b.labels)
    other, _ = make_data(DataConfig(**{**SMALL.__dict__, "seed": 1}))
    assert not np.array_equal(other.sparse, a_train.sparse)
    assert a_train.dense.shape == (40_000, DENSE_FEATURES) and a_train.dense.dtype == np.float32
    assert a_train.sparse.shape == (40_000, 6) and a_train.sparse.dtype == np.int64
    assert len(a_test) == 10_000


def test_ids_follow_a_zipf_law_inside_their_vocabularies():
    train, _ = make_data(SMALL)
    for f, vocab in enumerate(SMALL.vocab_sizes):
        ids = train.sparse[:, f]
        assert ids.min() >= 0 and ids.max() < vocab
        counts = np.sort(np.bincount(ids, minlength=vocab))[::-1]
        # the most frequent id is about 2**1.1 times as frequent as the second, 10**1.1 as the tenth
        assert 1.6 < counts[0] / counts[1] < 2.8
        assert 8 < counts[0] / counts[9] < 18


def test_the_planted_signal_is_there_and_the_labels_follow_it():
    _, test = make_data(SMALL)
    assert 0.2 < test.labels.mean() < 0.6
    assert roc_auc(test.labels, test.logits) > 0.85  # the ceiling a model can approach
    shuffled = np.random.default_rng(0).permutation(test.logits)
    assert abs(roc_auc(test.labels, shuffled) - 0.5) < 0.03


def test_shards_split_the_examples_between_workers():
    train, _ = make_data(SMALL)
    parts = [train.shard(i, 3) for i in range(3)]
    assert sum(len(p) for p in parts) == len(train)
    np.testing.assert_array_equal(parts[1].sparse[0], train.sparse[1])
    with pytest.raises(InvalidArgument, match="shard 3 of 3"):
        train.shard(3, 3)


def test_bad_config_is_refused_naming_the_fault():
    with pytest.raises(InvalidArgument, match="at least 2 ids"):
        DataConfig(vocab_sizes=(10, 1))
    with pytest.raises(InvalidArgument, match=r"features \[9\]"):
        DataConfig(vocab_sizes=(10, 10), effect_features=(9,), interaction_pair=(0, 1))


def test_roc_auc_matches_known_values():
    assert roc_auc(np.array([0, 0, 1, 1]), np.array([0.1, 0.4, 0.35, 0.8])) == pytest.approx(0.75)
    assert roc_auc(np.array([0, 1, 0, 1]), np.array([1.0, 2.0, 3.0, 4.0])) == pytest.approx(0.75)
    assert roc_auc(np.array([1, 0, 1, 0]), np.ones(4)) == pytest.approx(0.5)  # ties count half
    assert roc_auc(np.array([0, 0, 1]), np.array([0.0, 1.0, 1.0])) == pytest.approx(0.75)
    with pytest.raises(InvalidArgument, match="both clicks and non-clicks"):
        roc_auc(np.ones(3), np.arange(3.0))
    with pytest.raises(InvalidArgument, match="3 labels but 2 scores"):
        roc_auc(np.ones(3), np.arange(2.0))


def test_roc_auc_agrees_with_scikit_learn():
    metrics = pytest.importorskip("sklearn.metrics")
    rng = np.random.default_rng(3)
    labels = rng.random(5000) < 0.3
    scores = np.round(rng.normal(size=5000) + labels, 1)  # rounded: many ties
    assert roc_auc(labels, scores) == pytest.approx(metrics.roc_auc_score(labels, scores), abs=1e-12)


def test_the_model_gives_one_logit_per_example_and_sparse_table_gradients():
    torch = pytest.importorskip("torch")
    from zmqflow.examples.dlrm.model import DLRM, torch_embedding_bag

    made = []

    def factory(feature, rows, dim):
        made.append((feature, rows, dim))
        return torch_embedding_bag(feature, rows, dim)

    train, _ = make_data(SMALL)
    model = DLRM(SMALL.vocab_sizes, dim=8, embedding_bag=factory)
    assert made == [(f, rows, 8) for f, rows in enumerate(SMALL.vocab_sizes)]
    out = model(torch.from_numpy(train.dense[:32]), torch.from_numpy(train.sparse[:32]))
    assert out.shape == (32,)
    out.sum().backward()
    assert model.tables[0].weight.grad.is_sparse
    assert model.bottom[0].weight.grad is not None and model.top[0].weight.grad is not None
    with pytest.raises(InvalidArgument, match=r"sparse must be \(batch, 6\)"):
        model(torch.from_numpy(train.dense[:4]), torch.from_numpy(train.sparse[:4, :3]))


def test_the_reference_finds_the_planted_signal():
    torch = pytest.importorskip("torch")
    from zmqflow.examples.dlrm.reference import TrainConfig, train_reference

    torch.set_num_threads(1)
    train, test = make_data(SMALL)
    result = train_reference(train, test, SMALL.vocab_sizes, TrainConfig(steps=150, batch=512))
    assert result["auc"] > 0.75, result


def test_the_demo_trains_dlrm_over_a_local_cluster(procs, tmp_path):
    pytest.importorskip("torch")
    out = tmp_path / "r.json"
    p = procs([*ZMQFLOW, "demo", "--model", "dlrm", "--steps", "40", "--batch", "512", "--samples", "60000",
               "--result", str(out)])
    assert p.wait(100) == 0, p.output
    auc_lines = [line for line in p.lines if line.startswith("AUC ")]
    assert len(auc_lines) == 1, p.output
    auc = float(re.match(r"AUC (\d\.\d{3}) ", auc_lines[0]).group(1))
    result = json.loads(out.read_text())
    assert auc == pytest.approx(result["auc"], abs=1e-3)
    assert auc > 0.6 and result["reference_auc"] > 0.6  # 40 steps already find the strongest effects
    assert result["workers"] == 2 and result["ps"] == 2 and result["steps"] == 40
    assert result["embedding_ms"] > 0 and result["dense_comm_ms"] > 0 and result["compute_ms"] > 0
    assert "reference" in auc_lines[0] and "samples/s" in p.output and "dense communication" in p.output
    assert any("step 40/40" in line for line in p.lines), p.output  # the progress bar reached its end


@pytest.fixture
def runtime():
    """This process as worker:0 of a private cluster beside one ps:0."""
    pytest.importorskip("torch")
    from zmqflow.bridge import runtime as rt

    yield rt.init(timeout=30)
    rt.shutdown()


def test_hybrid_puts_tables_on_ps_shards_and_steps_the_rest(runtime):
    import torch

    from zmqflow.examples.dlrm.model import DLRM
    from zmqflow.state.optim import Adagrad
    from zmqflow.torch.embedding import EmbeddingBag
    from zmqflow.torch.hybrid import HybridStrategy

    torch.manual_seed(0)
    train, _ = make_data(SMALL)
    model = DLRM(SMALL.vocab_sizes, dim=8)
    local_tables = [t.weight for t in model.tables]
    dense_opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    hybrid = HybridStrategy(model, dense_opt, embedding_optimizer=Adagrad(0.5), prefix="test/")
    assert all(isinstance(t, EmbeddingBag) for t in model.tables)
    assert [t.name for t in model.tables] == [f"test/tables.{f}" for f in range(len(SMALL.vocab_sizes))]
    held = {id(p) for group in dense_opt.param_groups for p in group["params"]}
    assert not held & {id(w) for w in local_tables}  # the local weights left the dense optimizer
    valued = {id(p) for p in model.parameters() if p.numel()}  # not the tables' switches, which hold nothing
    assert valued <= {id(p) for g in hybrid.optimizer.param_groups for p in g["params"]}

    batch = train.batch(slice(0, 64))
    ids = torch.from_numpy(batch.sparse[:, 5].copy())
    before = model.tables[5].read(ids).clone()
    dense_before = model.top[0].weight.detach().clone()
    for _ in range(3):
        hybrid.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(
            model(torch.from_numpy(batch.dense), torch.from_numpy(batch.sparse)), torch.from_numpy(batch.labels))
        loss.backward()
        hybrid.step()
    hybrid.flush()
    assert not torch.equal(model.tables[5].read(ids), before)  # the shards applied the sparse gradients
    assert not torch.equal(model.top[0].weight, dense_before)  # and the dense optimizer stepped
    t = hybrid.times
    assert t.steps == 3 and t.embedding_s > 0 and t.total_s >= t.embedding_s + t.dense_comm_s


def test_hybrid_refuses_what_it_cannot_do(runtime):
    import torch

    from zmqflow.torch.hybrid import HybridStrategy

    model = torch.nn.Sequential(torch.nn.EmbeddingBag(10, 4), torch.nn.EmbeddingBag(10, 4, padding_idx=0))
    with pytest.raises(InvalidArgument, match="table '1' uses max_norm, padding_idx or scale_grad_by_freq"):
        HybridStrategy(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert isinstance(model[0], torch.nn.EmbeddingBag)  # nothing was changed
    for table, needle in ((torch.nn.EmbeddingBag(10, 4, scale_grad_by_freq=True), "uses max_norm, padding_idx or "
                                                                                   "scale_grad_by_freq"),
                          (torch.nn.EmbeddingBag(10, 4, dtype=torch.float64), "torch.float64")):
        model = torch.nn.Sequential(torch.nn.EmbeddingBag(10, 4), table)
        with pytest.raises(InvalidArgument, match=f"table '1' {needle}" if needle.startswith("uses") else needle):
            HybridStrategy(model, torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1))
        assert isinstance(model[0], torch.nn.EmbeddingBag) and model[1] is table
    model = torch.nn.Sequential(torch.nn.EmbeddingBag(10, 4))
    opt = torch.optim.Adagrad(model.parameters(), lr=0.1)
    model(torch.tensor([[1, 2]])).sum().backward()
    opt.step()
    with pytest.raises(InvalidArgument, match="already stepped"):
        HybridStrategy(model, opt)
    with pytest.raises(InvalidArgument, match="dense_optimizer must be a torch.optim.Optimizer"):
        HybridStrategy(torch.nn.Linear(2, 2), "adam")


def test_hybrid_accumulates_passes_and_pushes_each_table_once_a_step(runtime):
    """backward_passes_per_step=2: the dense gradients are summed over both passes before their
    average, and each table's two passes reach the shards as one push at step()."""
    import torch

    from zmqflow.errors import InvalidArgument as Invalid
    from zmqflow.state.optim import Adagrad
    from zmqflow.torch.hybrid import HybridStrategy

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.EmbeddingBag(10, 4, mode="sum"), torch.nn.Linear(4, 1))
    hybrid = HybridStrategy(model, torch.optim.SGD(model.parameters(), lr=0.1), embedding_optimizer=Adagrad(0.5),
                            prefix="accum/", backward_passes_per_step=2)
    table = model[0]
    assert table.push == "step"
    ids = torch.arange(10)
    rows, dense = table.read(ids).clone(), model[1].weight.detach().clone()
    batches = [torch.tensor([[1, 2], [3, 1]]), torch.tensor([[4, 1], [2, 2]])]
    grads = []
    for i, b in enumerate(batches):
        model(b).sum().backward()
        grads.append(model[1].weight.grad.clone())
        if i == 0:
            with pytest.raises(Invalid, match="before step"):
                hybrid.zero_grad()  # mid-accumulation: refused, and what the table holds stays
            assert table.held_passes == 1
    assert torch.equal(table.read(ids), rows)  # both passes read the step's rows: nothing pushed yet
    assert table.held_passes == 2 and table.counters["pushes"] == 0
    hybrid.step()
    hybrid.flush()
    assert table.held_passes == 0 and table.counters["pushes"] == 1
    moved = (table.read(ids) != rows).any(dim=1)
    assert moved.tolist() == [i in (1, 2, 3, 4) for i in range(10)]
    torch.testing.assert_close(model[1].weight, dense - 0.1 * grads[1])  # the sum of both passes, one rank
    with pytest.raises(Invalid, match="backward_passes_per_step must be an integer >= 1, got 0"):
        HybridStrategy(torch.nn.Sequential(torch.nn.Linear(2, 2)), torch.optim.SGD([torch.nn.Parameter(torch.ones(1))]),
                       backward_passes_per_step=0)


def test_hybrid_pushes_the_sharded_embeddings_the_model_already_holds(runtime):
    """A zmqflow.torch.Embedding (not an EmbeddingBag) kept as it is: step() pushes what it holds."""
    import torch

    from zmqflow.state.optim import SGD
    from zmqflow.torch.embedding import Embedding
    from zmqflow.torch.hybrid import HybridStrategy

    emb = Embedding("kept/emb", 10, 3, optimizer=SGD(1.0), push="step")
    model = torch.nn.Sequential(emb, torch.nn.Linear(3, 1))
    hybrid = HybridStrategy(model, torch.optim.SGD(model[1].parameters(), lr=0.1), prefix="kept/")
    assert emb in hybrid.tables
    ids = torch.arange(10)
    rows = emb.read(ids).clone()
    model(torch.tensor([1, 2, 2])).sum().backward()
    hybrid.step()
    hybrid.flush()
    assert emb.held_passes == 0 and emb.counters["pushes"] == 1
    assert (emb.read(ids) != rows).any(dim=1).tolist() == [i in (1, 2) for i in range(10)]
