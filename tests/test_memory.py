"""plan_memory itemises what the runtime really allocates."""
import tinyloop
from tinyloop.memory import blocks_for


def test_plan_sizes_the_pool_a_budgeted_model_holds(make_artifact):
    """A model loaded with the plan's total as its budget holds exactly the planned pool, and no more."""
    for mode in ("fp16", "int8", "int4"):
        probe = tinyloop.load_model(make_artifact(), 128, cache_mode=mode)
        plan = tinyloop.plan_memory(probe, lanes=4, max_seq_len=64, loops=4)
        assert plan.bytes_of("weights") == sum(p.numel() * p.element_size() for p in probe.net.parameters())
        model = tinyloop.load_model(make_artifact(), 64, cache_mode=mode, memory_budget=plan.total_bytes)
        assert model.pool.nbytes == plan.bytes_of("KV block pool")
        assert plan.holds(64, 4) == 4 and plan.holds(64, 8) < 4
        assert model.pool.block_bytes * model.pool.num_blocks == 4 * blocks_for(model.cfg, 64, 4) * model.pool.block_bytes


def test_plan_counts_handles_and_checks_budget(make_artifact):
    model = tinyloop.load_model(make_artifact(), 128)
    base = tinyloop.plan_memory(model)
    with_handles = tinyloop.plan_memory(model, max_handles=10, handle_tokens=100)
    assert with_handles.bytes_of("handle states") > 0
    assert with_handles.bytes_of("KV block pool") > base.bytes_of("KV block pool")
    with_handles.check(with_handles.total_bytes)
    try:
        with_handles.check(base.total_bytes, "test budget")
        raise AssertionError("over-budget plan passed")
    except tinyloop.BudgetError as e:
        assert "exceeds the test budget" in str(e) and "handle" in str(e) and "weights" in str(e)


def test_plan_from_config_alone_equals_plan_from_model(make_artifact):
    model = tinyloop.load_model(make_artifact(), 128)
    from_cfg = tinyloop.plan_memory(model.cfg, 128, "fp16")
    assert from_cfg.total_bytes == tinyloop.plan_memory(model).total_bytes


def test_fused_decode_weights_are_not_a_second_copy(make_artifact):
    """The forward fuses q|k|v and gate|up; the model's own weights become views of the fused ones."""
    model = tinyloop.load_model(make_artifact(), 64)
    tinyloop.generate(model, [5, 6, 7], tinyloop.GenerateConfig(max_tokens=3))
    from tinyloop.model import fused_weights
    weights = fused_weights(model.net)
    for blocks, fused in zip((model.net.prelude, model.net.core, model.net.coda), (weights.prelude, weights.core, weights.coda)):
        for block, w in zip(blocks, fused):
            assert block.attn.wq.weight.untyped_storage().data_ptr() == w.wqkv.untyped_storage().data_ptr()
            assert block.mlp.w_up.weight.untyped_storage().data_ptr() == w.wgu.untyped_storage().data_ptr()
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.net.parameters()}
    assert sum(storages.values()) == tinyloop.plan_memory(model).bytes_of("weights")
