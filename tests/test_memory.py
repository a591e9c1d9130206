"""plan_memory itemises what the runtime really allocates."""
import tinyloop
from tinyloop.cache import KVCache


def test_plan_matches_allocated_bytes(make_artifact):
    for mode in ("fp16", "int8", "int4"):
        model = tinyloop.load_model(make_artifact(), 128, cache_mode=mode)
        plan = tinyloop.plan_memory(model)
        assert plan.bytes_of("weights") == sum(p.numel() * p.element_size() for p in model.net.parameters())
        assert plan.bytes_of("decode cache") == model.decode_cache.nbytes()
        lanes = tinyloop.plan_memory(model, lanes=4, max_seq_len=64)
        assert lanes.bytes_of("decode cache") == KVCache(model.cfg, 4, 64, mode).nbytes()
        assert plan.total_bytes == plan.bytes_of("weights") + plan.bytes_of("decode cache")


def test_plan_counts_handles_and_checks_budget(make_artifact):
    model = tinyloop.load_model(make_artifact(), 128)
    base = tinyloop.plan_memory(model)
    with_handles = tinyloop.plan_memory(model, max_handles=10, handle_tokens=100)
    assert with_handles.bytes_of("handles") > 0
    assert with_handles.total_bytes == base.total_bytes + with_handles.bytes_of("handles")
    with_handles.check(with_handles.total_bytes)
    try:
        with_handles.check(base.total_bytes, "test budget")
        raise AssertionError("over-budget plan passed")
    except tinyloop.BudgetError as e:
        assert "exceeds the test budget" in str(e) and "handles" in str(e) and "weights" in str(e)


def test_plan_from_config_alone_equals_plan_from_model(make_artifact):
    model = tinyloop.load_model(make_artifact(), 128)
    from_cfg = tinyloop.plan_memory(model.cfg, 128, "fp16")
    assert from_cfg.total_bytes == tinyloop.plan_memory(model).total_bytes


def test_fused_decode_weights_are_not_a_second_copy(make_artifact):
    """The lean decode step fuses q|k|v and gate|up; the model's own weights become views of the fused ones."""
    model = tinyloop.load_model(make_artifact(), 64)
    tinyloop.generate(model, [5, 6, 7], tinyloop.GenerateConfig(max_tokens=3))
    from tinyloop.kernels.lean import model_weights
    for blocks, fused in zip((model.net.prelude, model.net.core, model.net.coda), model_weights(model.net)):
        for block, w in zip(blocks, fused):
            assert block.attn.wq.weight.untyped_storage().data_ptr() == w.wqkv.untyped_storage().data_ptr()
            assert block.mlp.w_up.weight.untyped_storage().data_ptr() == w.wgu.untyped_storage().data_ptr()
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.net.parameters()}
    assert sum(storages.values()) == tinyloop.plan_memory(model).bytes_of("weights")
