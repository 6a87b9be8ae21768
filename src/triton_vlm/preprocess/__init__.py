"""The preprocess stage: a request's prompt, images and videos -> the ids and pixels the next stages take.

- `prompt.py`: the prompt split into text, image and video parts (inline `<img>` tags, markers);
- `images.py` / `image_cache.py`: image payloads decoded and checked, the checkpoint's image processor, the LRU of
  processed images; `videos.py`: video files decoded, sampled and cut into patches;
- `checkpoint.py`: what tokenization needs to know about a checkpoint (its placeholders, layout, bos / eos);
- `service.py`: `Preprocessor`, one request end to end (tokenization in context, truncation that never splits an
  image), and `stack_rows` for a request of several rows.
"""
