"""``kvstore.adapters.exo.install`` in a process where ``exo`` is a stand-in package with exo's
builder shape (``tests/system/test_exo.py`` writes it): build a node's cache the way exo's runner
does (``load(bound_instance)``, then ``build()``), use it, build again (a restart) and
report what was built; then ``uninstall``.

Run as ``python -m tests.support.programs.exo_install JSON`` (``{"dir", "shard"}``).
"""


class PipelineShardMetadata:
    """exo's shard metadata's fields (a pydantic model in exo)."""

    def __init__(self, model_id: str, **fields: int) -> None:
        from types import SimpleNamespace

        self.model_card = SimpleNamespace(model_id=model_id)
        self.__dict__.update(fields)


def main() -> None:
    import json
    import sys
    from types import SimpleNamespace

    import mlx.core as mx

    from kvstore.adapters import exo as kv_exo
    from tests.support.programs.exo_generate import request
    from tools.testing.model_builds import load_model

    job = json.loads(sys.argv[1])
    fields = {k: v for k, v in job["shard"].items() if k not in ("kind", "model_id")}
    bound = SimpleNamespace(bound_shard=PipelineShardMetadata(job["shard"]["model_id"], **fields))
    kv_exo.install(cache_dir=job["dir"], chunk_tokens=64)
    from exo.worker.engines.mlx.builder import MlxBuilder

    model, _ = load_model("tiny-llama")
    prompt = [3 + (i * 37) % 240 for i in range(100)]
    caches = []
    for _ in range(2):  # a node, then the same node restarted
        builder = MlxBuilder()
        assert list(builder.load(bound)) == ["loading"]
        caches.append(builder.build())
        got = request(caches[-1], model, prompt)
        caches[-1].close()
    kv_exo.uninstall()
    after = MlxBuilder().build()
    pc = caches[0]
    print(json.dumps({"built": type(pc).__name__, "model_path": str(pc.model_path),
                      "shard": kv_exo.shard_components(pc.shard), "n": got["n"],
                      "after_uninstall": type(after).__name__, "mx": mx.__version__}))


if __name__ == "__main__":
    main()
