"""checkpoint.ModelInfo / pipelines and preprocess.Preprocessor against the checkpoint's own LlavaProcessor."""
import base64
import io
import json
import shutil

import numpy as np
import pytest
from PIL import Image

from triton_vlm.preprocess.checkpoint import CheckpointError, ModelInfo, available_pipelines, get_pipeline, pipeline_for_config
from triton_vlm.errors import InvalidArgument
from triton_vlm.preprocess.service import Preprocessor

PROMPT = "USER: <image>\nWhat color is the shape? ASSISTANT:"
LONG = "The quick brown fox jumps over the lazy dog. " * 6


def png(color, size=(40, 24)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, "PNG")
    return buf.getvalue()


RED, BLUE = png((220, 30, 30)), png((30, 60, 220), (24, 40))


@pytest.fixture(scope="session")
def ckpt(tmp_path_factory):
    import torch

    torch.set_num_threads(1)
    from triton_vlm.demo.checkpoint import build_random_llava

    return build_random_llava(tmp_path_factory.mktemp("llava_pre"), image_size=32, patch_size=8,
                              max_position_embeddings=512)


@pytest.fixture(scope="session")
def pp(ckpt):
    return Preprocessor(ckpt)


@pytest.fixture(scope="session")
def hf(ckpt):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(str(ckpt))


def variant(ckpt, tmp_path, config=None, processor=None, generation=None):
    """Copy of the checkpoint without weights, with edited JSON files."""
    d = tmp_path / "variant"
    shutil.copytree(ckpt, d, ignore=shutil.ignore_patterns("*.safetensors"))
    for name, edit in (("config.json", config), ("processor_config.json", processor),
                       ("generation_config.json", generation)):
        if edit:
            cfg = json.loads((d / name).read_text())
            edit(cfg)
            (d / name).write_text(json.dumps(cfg))
    return d


@pytest.fixture(scope="session")
def sp_ckpt(ckpt, tmp_path_factory):
    """The checkpoint with a sentencepiece-style tokenizer (Metaspace, prefix space only at the very start),
    where tokenizing parts separately would differ from tokenizing in context."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    d = tmp_path_factory.mktemp("sp") / "ck"
    shutil.copytree(ckpt, d, ignore=shutil.ignore_patterns("*.safetensors"))
    special = ["<unk>", "<s>", "</s>", "<pad>", "<image>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    trainer = trainers.BpeTrainer(vocab_size=320, show_progress=False,
                                  special_tokens=special + [f"<0x{i:02X}>" for i in range(256)])
    tok.train_from_iterator([PROMPT.replace("<image>", ""), LONG, "Describe the image. a red circle"] * 3,
                            trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                            pad_token="<pad>", extra_special_tokens={"image_token": "<image>"}).save_pretrained(d)
    return d


# --- ModelInfo and pipelines -------------------------------------------------------------------------------
def test_model_info_reads_the_checkpoint(pp, ckpt):
    info = pp.info
    assert (info.pipeline, info.model_class) == ("llava", "LlavaForConditionalGeneration")
    assert (info.image_token, info.image_token_id, info.num_image_tokens) == ("<image>", 4, 16)  # (32/8)^2
    assert info.image_size == (32, 32) and info.vision_feature_select_strategy == "default"
    assert (info.bos_token_id, info.eos_token_ids, info.pad_token_id, info.add_bos) == (1, (2,), 3, True)
    assert (info.context_length, info.vocab_size, info.hidden_size) == (512, 392, 64)
    assert (info.image_start, info.image_end) == ("", "")
    over = ModelInfo.load(ckpt, context_length=100, image_start="<Img>", image_end="</Img>")
    assert (over.context_length, over.image_start, over.image_end) == (100, "<Img>", "</Img>")


def test_full_strategy_keeps_cls_and_eos_list(ckpt, tmp_path):
    def full(c):
        c["vision_feature_select_strategy"] = "full"

    def proc_full(c):
        c["vision_feature_select_strategy"] = "full"

    def eos_list(c):
        c["eos_token_id"] = [2, 3]

    info = ModelInfo.load(variant(ckpt, tmp_path, full, proc_full, eos_list))
    assert info.num_image_tokens == 17 and info.eos_token_ids == (2, 3)


def test_num_additional_image_tokens_honoured_or_inferred(ckpt, tmp_path):
    def no_extra(c):
        del c["num_additional_image_tokens"]

    assert ModelInfo.load(variant(ckpt, tmp_path, processor=no_extra)).num_image_tokens == 16  # CLIP: CLS inferred
    shutil.rmtree(tmp_path / "variant")

    def zero_extra(c):
        c["num_additional_image_tokens"] = 0  # e.g. a tower without CLS

    assert ModelInfo.load(variant(ckpt, tmp_path, processor=zero_extra)).num_image_tokens == 15


def test_pipeline_registry():
    assert "llava" in available_pipelines()
    assert get_pipeline("llava").model_class == "LlavaForConditionalGeneration"
    with pytest.raises(CheckpointError, match="unknown pipeline 'minigpt4'; available: llava"):
        get_pipeline("minigpt4")
    assert pipeline_for_config({"architectures": ["LlavaForConditionalGeneration"]}).name == "llava"
    assert pipeline_for_config({"model_type": "llava"}).name == "llava"
    assert pipeline_for_config({"model_type": "bert", "architectures": ["BertModel"]}) is None


def test_unsupported_checkpoints_raise_clear_errors(ckpt, tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        ModelInfo.load(tmp_path)

    def bert(c):
        c["model_type"], c["architectures"] = "bert", ["BertModel"]

    d = variant(ckpt, tmp_path, config=bert)
    with pytest.raises(CheckpointError, match=r"unsupported checkpoint: model_type 'bert'.*supported: llava"):
        ModelInfo.load(d)
    shutil.rmtree(d)

    def big_tower(c):
        c["vision_config"]["image_size"] = 64

    with pytest.raises(CheckpointError, match="produces 32x32 images but the vision tower expects 64x64"):
        ModelInfo.load(variant(ckpt, tmp_path, config=big_tower))


# --- exactness against LlavaProcessor ----------------------------------------------------------------------
def test_canonical_prompt_equals_llava_processor(pp, hf):
    out = pp(PROMPT, [RED], max_tokens=16, bad_words=[], stop_words=[])
    ref = hf(text=PROMPT, images=[Image.open(io.BytesIO(RED)).convert("RGB")], return_tensors="pt")
    assert out.input_ids == ref.input_ids[0].tolist()
    assert out.input_ids.count(4) == 16 and out.input_ids[0] == 1 and out.input_ids.count(1) == 1
    assert out.pixel_values.dtype == np.float32 and out.pixel_values.shape == (1, 3, 32, 32)
    np.testing.assert_allclose(out.pixel_values, ref.pixel_values.numpy(), atol=1e-5, rtol=0)
    assert out.dropped_images == 0


def test_sentencepiece_tokenizer_multi_image_inline_equals_llava_processor(sp_ckpt):
    from transformers import AutoProcessor

    inline = f'<img src="data:image/jpeg;base64,{base64.b64encode(BLUE).decode()}">'  # PNG under jpeg label
    text = f"USER: <image>\nWhat color is the shape? {inline} and the second? ASSISTANT:"
    out = Preprocessor(sp_ckpt)(text, [RED], 8, [], [])
    hf_text = text.replace(inline, "<image>")
    pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in (RED, BLUE)]
    ref = AutoProcessor.from_pretrained(str(sp_ckpt))(text=hf_text, images=pil, return_tensors="pt")
    assert out.input_ids == ref.input_ids[0].tolist() and out.input_ids.count(4) == 32
    np.testing.assert_allclose(out.pixel_values, ref.pixel_values.numpy(), atol=1e-5, rtol=0)


def test_start_end_markers_are_tokenized_around_the_image(ckpt, hf):
    pre = Preprocessor(ckpt, image_start="<Img>", image_end="</Img>")
    out = pre(PROMPT, [RED], 4, [], [])
    ref = hf(text=PROMPT.replace("<image>", "<Img><image></Img>"),
             images=[Image.open(io.BytesIO(RED)).convert("RGB")])
    assert out.input_ids == list(ref["input_ids"][0])


def test_text_only_prompt(pp):
    out = pp("Say hello.", [], 4, [], [])
    assert out.input_ids == pp.tokenizer("Say hello.")["input_ids"]
    assert out.pixel_values.shape == (0, 3, 32, 32) and out.dropped_images == 0


def test_base64_and_data_url_images_equal_raw(pp):
    raw = pp(PROMPT, [RED], 4, [], [])
    for payload in (base64.b64encode(RED), base64.b64encode(RED).decode(),
                    "data:image/jpeg;base64," + base64.b64encode(RED).decode()):
        out = pp(PROMPT, [payload], 4, [], [])
        assert out.input_ids == raw.input_ids
        np.testing.assert_array_equal(out.pixel_values, raw.pixel_values)
    assert pp(PROMPT.encode(), [RED], 4, [], []).input_ids == raw.input_ids  # text_input as bytes


def test_words(pp):
    out = pp("hi", [], 4, bad_words=["red", "", b"blue sky"], stop_words=["ASSISTANT:", ""])
    assert out.bad_words_ids == [pp.tokenizer("red", add_special_tokens=False)["input_ids"],
                                 pp.tokenizer("blue sky", add_special_tokens=False)["input_ids"]]
    assert out.stop_words_ids == [pp.tokenizer("ASSISTANT:", add_special_tokens=False)["input_ids"]]
    assert all(1 not in w for w in out.bad_words_ids + out.stop_words_ids)


# --- truncation --------------------------------------------------------------------------------------------
def test_truncation_cuts_text_from_the_left_and_keeps_bos(ckpt, pp):
    text = LONG + PROMPT
    full = pp(text, [RED], 4, [], []).input_ids
    pre = Preprocessor(ckpt, context_length=64)
    out = pre(text, [RED], 10, [], [])  # budget 54
    assert len(full) > 54 and len(out.input_ids) == 54
    assert out.input_ids == [1] + full[-53:]
    assert out.dropped_images == 0 and out.pixel_values.shape[0] == 1


def test_truncation_drops_whole_images_and_their_pixels(ckpt, pp):
    text = "A picture <image> and another <image>\nWhat color is the shape? ASSISTANT:"
    full = pp(text, [RED, BLUE], 4, [], [])
    second = max(i for i in range(len(full.input_ids)) if full.input_ids[i] == 4) - 15  # first id of image 2
    keep = len(full.input_ids) - second + 1  # image 2 and what follows + one token of the text before it
    pre = Preprocessor(ckpt, context_length=64)
    out = pre(text, [RED, BLUE], 64 - (keep + 1), [], [])
    assert out.input_ids == [1] + full.input_ids[-keep:]
    assert out.dropped_images == 1 and out.input_ids.count(4) == 16
    np.testing.assert_array_equal(out.pixel_values, full.pixel_values[1:])
    # one token less: the text piece goes, image 1 cannot be split, so it is dropped too
    out = pre(text, [RED, BLUE], 64 - keep, [], [])
    assert out.input_ids == [1] + full.input_ids[-(keep - 1):] and out.dropped_images == 1


def test_image_larger_than_budget_is_an_error_with_sizes(ckpt):
    pre = Preprocessor(ckpt, context_length=24)
    with pytest.raises(InvalidArgument, match=r"leaves 14 prompt tokens.*last image alone takes 16 tokens"):
        pre("Describe <image>", [RED], 10, [], [])


@pytest.mark.parametrize("max_tokens,needle", [(513, "max_tokens must be in \\[1, 512\\]"), (0, "in \\[1, 512\\]"),
                                               (512, "leaves 0 prompt tokens")])
def test_max_tokens_bounds(pp, max_tokens, needle):
    with pytest.raises(InvalidArgument, match=needle):
        pp(PROMPT, [RED], max_tokens, [], [])


def test_every_image_is_validated_even_if_truncated_away(ckpt):
    pre = Preprocessor(ckpt, context_length=64)
    text = "A <image> B <image>\nWhat color is the shape? ASSISTANT:"
    assert pre(text, [RED, BLUE], 30, [], []).dropped_images == 1
    with pytest.raises(InvalidArgument, match=r"images\[0\] is not an image"):
        pre(text, [b"not an image, just bytes!", BLUE], 30, [], [])


# --- request errors and loading once -----------------------------------------------------------------------
def test_request_errors(ckpt, pp):
    with pytest.raises(InvalidArgument, match="1 <image> markers but 2 images"):
        pp(PROMPT, [RED, BLUE], 4, [], [])
    with pytest.raises(InvalidArgument, match="too many images: 3"):
        Preprocessor(ckpt, max_images=2)("<image><image><image>", [RED] * 3, 4, [], [])
    with pytest.raises(InvalidArgument, match="text_input is not valid UTF-8"):
        pp(b"\xff\xfe", [], 4, [], [])
    custom = Preprocessor(ckpt, marker="[IMG]")  # "<image>" is then the raw placeholder token: refused
    with pytest.raises(InvalidArgument, match="image placeholder token '<image>' outside an image"):
        custom("look <image> here", [], 4, [], [])
    assert custom("look [IMG] here", [RED], 4, [], []).input_ids.count(4) == 16


def test_no_reloading_per_call(pp, monkeypatch):
    import transformers

    def boom(*a, **k):
        raise AssertionError("reloaded")

    for cls in ("AutoProcessor", "AutoTokenizer", "AutoImageProcessor", "AutoConfig"):
        monkeypatch.setattr(getattr(transformers, cls), "from_pretrained", boom)
    for _ in range(3):
        assert pp(PROMPT, [RED], 4, ["red"], []).input_ids.count(4) == 16


def test_repeated_images_come_from_the_cache(ckpt, monkeypatch):
    import triton_vlm.preprocess.service as mod

    pre = Preprocessor(ckpt, image_cache_size=2)
    calls = []
    real = mod.decode_image
    monkeypatch.setattr(mod, "decode_image", lambda *a, **k: calls.append(1) or real(*a, **k))
    a, b, c = png((255, 0, 0)), png((0, 255, 0), (30, 50)), png((0, 0, 255))
    prompt = "USER: <image>\nWhat color is the shape? ASSISTANT:"
    first = pre(prompt, [a], max_tokens=8)
    assert len(calls) == 1
    again = pre(prompt, [base64.b64encode(a).decode()], max_tokens=8)  # same file, other wire form: a hit
    assert len(calls) == 1 and pre.cache.hits == 1
    np.testing.assert_array_equal(again.pixel_values, first.pixel_values)
    pre(prompt, [b], max_tokens=8)
    pre(prompt, [c], max_tokens=8)  # evicts a (least recently used)
    assert len(pre.cache) == 2 and len(calls) == 3
    pre(prompt, [a], max_tokens=8)
    assert len(calls) == 4
    uncached = Preprocessor(ckpt, image_cache_size=0)(prompt, [a], max_tokens=8)
    np.testing.assert_array_equal(uncached.pixel_values, first.pixel_values)


def test_too_many_words_are_refused_before_tokenizing(pp):
    with pytest.raises(InvalidArgument, match="bad_words holds 1025 words; at most 1024"):
        pp("USER: hi ASSISTANT:", max_tokens=4, bad_words=["x"] * 1025)


def test_rows_of_a_batched_request_are_padded_and_decode_back(pp):
    from triton_vlm import names as N
    from triton_vlm.params import words_from_flat
    from triton_vlm.preprocess.service import stack_rows

    rows = [pp(PROMPT.replace("<image>", "<image><image>"), [RED, BLUE], max_tokens=4, bad_words=["red", "x y"]),
            pp("USER: hi ASSISTANT:", max_tokens=4, stop_words=["."])]
    out = stack_rows(rows)
    assert out[N.NUM_IMAGES].tolist() == [[2], [0]] and out[N.DROPPED_IMAGES].tolist() == [[0], [0]]
    assert out[N.PIXEL_VALUES].shape == (2, 2, *rows[0].pixel_values.shape[1:])
    assert np.array_equal(out[N.PIXEL_VALUES][0], rows[0].pixel_values) and not out[N.PIXEL_VALUES][1].any()
    assert out[N.IMAGE_SIZES].tolist() == [rows[0].image_sizes.tolist(), [[0, 0], [0, 0]]]
    for i, r in enumerate(rows):
        ids = out[N.INPUT_IDS][i].tolist()
        assert ids[:len(r.input_ids)] == r.input_ids and set(ids[len(r.input_ids):]) <= {N.INPUT_IDS_PAD}
        assert words_from_flat(out[N.BAD_WORDS_IDS][i]) == r.bad_words_ids
        assert words_from_flat(out[N.STOP_WORDS_IDS][i]) == r.stop_words_ids
    one = stack_rows(rows[:1])  # a single row is not padded
    assert one[N.INPUT_IDS].shape == (1, len(rows[0].input_ids))
    with pytest.raises(InvalidArgument, match="malformed"):
        words_from_flat([1, 5, 0, 3])  # a zero length followed by more ids is not padding
