"""``HybridStrategy(initializer=...)``: each table it places draws its own rows, as torch's tables
drawn one after another do, and the same names give the same rows on every run and rank."""

from __future__ import annotations

import zlib

import pytest

import zmqflow as zf

torch = pytest.importorskip("torch")

from zmqflow.torch.embedding import EmbeddingBag  # noqa: E402
from zmqflow.torch.hybrid import HybridStrategy  # noqa: E402


def _placed(prefix: str, initializer: zf.init.Initializer) -> torch.nn.ModuleList:
    model = torch.nn.ModuleList([torch.nn.EmbeddingBag(100, 8, mode="sum"), torch.nn.EmbeddingBag(40, 8, mode="sum"),
                                 torch.nn.Linear(8, 1)])
    HybridStrategy(model, torch.optim.SGD(model.parameters(), lr=0.1), prefix=prefix, initializer=initializer)
    return model


def test_tables_given_one_seeded_initializer_differ(local):
    """As the DLRM example passes it: one uniform initializer, one seed, for every table."""
    seed = zlib.crc32(b"dlrm")
    model = _placed("init/", zf.init.uniform(-0.05, 0.05, seed=seed))
    a, b = model[0].weight, model[1].weight
    assert not torch.equal(a[:40], b) and not (a[:40] == b).all(dim=1).any()  # no row of one copies the other's
    assert a.abs().max() <= 0.05 and b.abs().max() <= 0.05 and a.std() > 0.01
    # reproducible: each table's rows are those of a seed made from the one given and its name alone
    for table in (model[0], model[1]):
        twin = EmbeddingBag(f"twin/{table.name}", table.num_embeddings, 8,
                            initializer=zf.init.uniform(-0.05, 0.05, seed=seed ^ zlib.crc32(table.name.encode())))
        assert torch.equal(twin.weight, table.weight)


def test_an_initializer_with_nothing_to_draw_stays_as_it_is(local):
    model = _placed("const/", zf.init.constant(0.25))
    assert (model[0].weight == 0.25).all() and (model[1].weight == 0.25).all()


def test_tables_given_no_initializer_are_torch_s_normal_each_seeded_by_its_name(local):
    model = torch.nn.ModuleList([torch.nn.EmbeddingBag(30, 8), torch.nn.Linear(8, 1)])
    HybridStrategy(model, torch.optim.SGD(model.parameters(), lr=0.1), prefix="default/")
    twin = EmbeddingBag("twin", 30, 8, initializer=zf.init.normal(stddev=1.0, seed=zlib.crc32(b"default/0")))
    assert torch.equal(model[0].weight, twin.weight)
