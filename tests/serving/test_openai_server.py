"""The OpenAI server's model-side defaults."""

from ray_specdec.serving.openai_server import generation_config


def test_an_embedded_models_generation_config_is_read_from_its_directory(monkeypatch):
    """An embedded model named as such (`target=target-neox`) has its generation defaults read from its directory,
    never looked up on the hub (offline it would take retries and come back empty: sampling defaults lost)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for name in ("target-neox", "drafter-mamba"):
        assert generation_config(name)["do_sample"] is False
