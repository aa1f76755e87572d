"""ai-toolkit model extension: `AI_TOOLKIT_MODELS` for ai-toolkit's registration.

ai-toolkit imports every package under its `extensions/` folder and collects `AI_TOOLKIT_MODELS`;
`video-dit aitk-install AITK_DIR` writes the two-line shim there that imports this list. Importing
this package needs ai-toolkit's `toolkit` on sys.path (an ImportError otherwise, which ai-toolkit's
registration catches); `import video_dit` never imports it.
"""

from video_dit.integrations.ai_toolkit.model import VideoDiTModel

AI_TOOLKIT_MODELS = [VideoDiTModel]

__all__ = ["AI_TOOLKIT_MODELS", "VideoDiTModel"]
