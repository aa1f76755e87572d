"""LTX-2 (Lightricks): the audio-video DiT (`dit.py`, its layers `layers.py`, its configuration
`dit_config.py`) and its checkpoint layouts (`convert.py`). Registered as a family by the lead."""
