"""The paged KV cache (`kv_cache.py`), prefix caching's block hashes (`prefix_cache.py`) and the KV-cache events
published from them (`kv_events.py`)."""
