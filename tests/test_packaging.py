"""What a wheel holds: setup.cfg lists every package of the tree (it cannot use find:, as it
maps cuda_src/ into the package), and ships the kernel sources as package data.
scripts/check_wheel.sh (run by CI) builds and installs the wheel itself."""
import configparser
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def setup_cfg():
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    return config


def test_every_package_of_the_tree_is_listed():
    listed = set(setup_cfg()["options"]["packages"].split())
    in_tree = {".".join(path.parent.relative_to(ROOT).parts)
               for path in (ROOT / "cupy_llama").rglob("__init__.py")}
    assert listed == in_tree | {"cupy_llama.cuda_src"}


def test_the_kernel_sources_are_package_data():
    options = setup_cfg()
    assert options["options"]["package_dir"].split() == ["cupy_llama.cuda_src", "=", "cuda_src"]
    patterns = options["options.package_data"]["cupy_llama.cuda_src"].replace(",", " ").split()
    shipped = {path.name for pattern in patterns for path in (ROOT / "cuda_src").glob(pattern)}
    assert shipped == {path.name for path in (ROOT / "cuda_src").iterdir()}
