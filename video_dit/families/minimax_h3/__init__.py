"""MiniMax H3 (MiniMaxAI/MiniMax-H3): the audio-video DiT over one packed sequence (`dit.py`, its layers
`layers.py`, its packed-sequence layout `packing.py`, its configuration `dit_config.py`) and its checkpoint
layouts (`convert.py`). Registered as a family by the lead."""
