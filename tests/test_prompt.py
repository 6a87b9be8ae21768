"""prompt.split_prompt: inline <img> tags, <image> markers paired with `images`, start/end markers, counts."""
import base64

import pytest

from triton_vlm.errors import InvalidArgument
from triton_vlm.preprocess.prompt import INLINE_IMAGE, ImagePart, TextPart, image_parts, split_prompt

PNG_SIG = b"\x89PNG\r\n\x1a\n"


def tag(data: bytes, label: str = "jpeg") -> str:
    return f'<img src="data:image/{label};base64,{base64.b64encode(data).decode()}">'


def test_markers_pair_with_images_in_order():
    parts = split_prompt("USER: <image>\nfirst <image> second", [b"A", b"B"])
    assert parts == [
        TextPart("USER: "),
        ImagePart(b"A", 0, "images[0]"),
        TextPart("\nfirst "),
        ImagePart(b"B", 1, "images[1]"),
        TextPart(" second"),
    ]


def test_text_only_prompt_is_one_part():
    assert split_prompt("hello there") == [TextPart("hello there")]
    assert split_prompt("") == []


def test_inline_tag_any_label_payload_kept_as_base64_text():
    data = PNG_SIG + b"rest"
    b64 = base64.b64encode(data).decode()
    for label in ("jpeg", "png", "webp", "svg+xml"):
        parts = split_prompt(f"a{tag(data, label)}b")
        assert parts == [TextPart("a"), ImagePart(b64, 0, "inline image 0 of text_input"), TextPart("b")]


def test_webui_regex_format_matches_exactly():
    s = tag(b"xyz")
    m = INLINE_IMAGE.fullmatch(s)
    assert m is not None and base64.b64decode(m.group("b64")) == b"xyz"


def test_img_tags_that_are_not_base64_data_stay_text():
    for s in ('<img src="http://example.com/a.png">', '<img src="data:text/plain;base64,QUJD">'):
        assert split_prompt(f"x {s} y") == [TextPart(f"x {s} y")]


def test_mixed_inline_and_markers():
    parts = split_prompt(f"{tag(b'I0')} one <image> two {tag(b'I1', 'png')}<image>", [b"L0", b"L1"])
    imgs = image_parts(parts)
    assert [p.index for p in imgs] == [0, 1, 2, 3]
    assert [p.what for p in imgs] == ["inline image 0 of text_input", "images[0]",
                                      "inline image 1 of text_input", "images[1]"]
    assert [p.payload for p in imgs] == [base64.b64encode(b"I0").decode(), b"L0",
                                         base64.b64encode(b"I1").decode(), b"L1"]
    assert [p.text for p in parts if isinstance(p, TextPart)] == [" one ", " two "]


def test_start_end_markers_as_in_seed_000():
    parts = split_prompt("text1<image>text2<image>text3", [b"1", b"2"], image_start="<Img>", image_end="</Img>")
    assert [p.text if isinstance(p, TextPart) else p.payload for p in parts] == [
        "text1<Img>", b"1", "</Img>text2<Img>", b"2", "</Img>text3"]


def test_markers_at_edges_and_adjacent_images():
    parts = split_prompt("<image><image>", [b"1", b"2"], image_start="[", image_end="]")
    assert [p.text if isinstance(p, TextPart) else p.payload for p in parts] == ["[", b"1", "][", b"2", "]"]
    # without start/end strings no empty text parts appear
    parts = split_prompt("<image><image>", [b"1", b"2"])
    assert [type(p) for p in parts] == [ImagePart, ImagePart]


@pytest.mark.parametrize("text,n_images,markers", [
    ("<image> and <image>", 1, 2),
    ("one <image>", 3, 1),
    ("no markers", 1, 0),
])
def test_count_mismatch_states_both_counts(text, n_images, markers):
    with pytest.raises(InvalidArgument) as e:
        split_prompt(text, [b"x"] * n_images)
    msg = str(e.value)
    assert f"{markers} <image> markers" in msg and f"{n_images} images" in msg


def test_inline_images_do_not_consume_the_images_list():
    with pytest.raises(InvalidArgument, match=r"0 <image> markers \(plus 1 inline .*1 images"):
        split_prompt(f"{tag(b'x')}", [b"extra"])


def test_max_images_counts_both_forms():
    split_prompt(f"{tag(b'x')}<image>", [b"y"], max_images=2)
    with pytest.raises(InvalidArgument, match="too many images: 3 .* at most 2"):
        split_prompt(f"{tag(b'x')}<image><image>", [b"y", b"z"], max_images=2)


def test_custom_marker_and_marker_inside_inline_tag_not_counted():
    assert len(image_parts(split_prompt("a [IMG] b [IMG]", [b"1", b"2"], marker="[IMG]"))) == 2
    parts = split_prompt("a [IMG] b", [b"1"], marker="[IMG]")
    assert parts == [TextPart("a "), ImagePart(b"1", 0, "images[0]"), TextPart(" b")]
    # with a custom marker, "<image>" is plain text
    assert split_prompt("<image>", [], marker="[IMG]") == [TextPart("<image>")]


@pytest.mark.parametrize("tag", ['<img src="data:image/jpeg;base64,@@@notbase64@@@">',
                                 "<img src='data:image/png;base64,AAAA'>",
                                 '<img alt="x" src="data:image/png;base64,AAAA">'])
def test_malformed_inline_tag_is_rejected(tag):
    with pytest.raises(InvalidArgument, match="malformed inline image"):
        split_prompt(f"USER: {tag} hi ASSISTANT:")
