"""clipstream.catalogue: a catalogue's stored items, on a local folder and on an fsspec filesystem."""

import numpy as np
import pytest

from clipstream import catalogue
from clipstream.catalogue import Catalogue, CatalogueError, Item
from clipstream.settings import Settings


@pytest.mark.parametrize("where", ["local", "memory"])
def test_items_and_images_are_stored_once_and_replaced_whole(tmp_path, where):
    root = str(tmp_path / "c") if where == "local" else f"memory://{tmp_path.name}/c"
    store = Catalogue(root, "mugs")
    assert store.items() == {}
    red, blue = store.put_image(b"red"), store.put_image(b"blue")
    assert store.put_image(b"red") == red and store.read_image(Item("x", image=red)) == b"red"
    store.write({"a": Item("a", text="a mug", image=red, metadata={"brand": "acme"}), "b": Item("b", image=blue)})
    assert Catalogue(root, "mugs").items() == {"a": Item("a", text="a mug", image=red, metadata={"brand": "acme"}),
                                               "b": Item("b", image=blue)}
    store.write({"a": Item("a", text="a mug")})  # b gone, and with it the only image no item names any more
    assert list(store.items()) == ["a"] and not store.image_path(Item("b", image=blue)).exists()
    assert not store.image_path(Item("a", image=red)).exists()
    if where == "local":  # written through a renamed temporary file: none is left behind
        assert sorted(p.name for p in (tmp_path / "c" / "mugs").iterdir()) == ["images", "items.jsonl"]


def test_names_ids_and_where_settings_put_catalogues(tmp_path):
    for bad in ("Mugs", "", "a b", "../x", "x" * 64):
        with pytest.raises(CatalogueError, match="catalogue name"):
            Catalogue(tmp_path, bad)
    for bad in ("", "-x", "a b", "x" * 129, "a\nb"):
        with pytest.raises(CatalogueError, match="item id"):
            catalogue.check_item_id(bad)
    assert catalogue.check_item_id("sku:42/red+L@eu") == "sku:42/red+L@eu"
    settings = Settings(home=tmp_path / "home", stream="shop")
    assert Catalogue.of(settings, "mugs").root == tmp_path / "home" / "catalogues" / "shop" / "mugs"
    assert str(Catalogue.of(Settings(home=tmp_path, catalogue_dir="s3://b/cats/"), "mugs").root) == \
        "s3://b/cats/clipstream/mugs"


def test_vectors_put_each_item_in_its_modalities_rows():
    items = [Item("a", text="t-a", image="x"), Item("b", image="y"), Item("c", text="t-c", metadata={"k": 1})]
    tv = catalogue.vectors("mugs", "3", items, np.ones((2, 4)), np.ones((2, 4)))
    assert (tv.kind, tv.model_version, tv.item_ids) == ("catalogue", "3", ["a", "b", "c"])
    assert (tv.ids("image"), tv.ids("text"), tv.captions) == (["a", "b"], ["a", "c"], ["t-a", "t-c"])
    assert tv.metadata == [{}, {}, {"k": 1}] and tv.task_index == catalogue.TASK_INDEX
