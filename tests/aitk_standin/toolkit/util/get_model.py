"""Stand-in registration: `extensions/<pkg>` exporting `AI_TOOLKIT_MODELS`, first `arch` match wins."""

import importlib
import os
import pkgutil

TOOLKIT_ROOT = os.environ.get("AITK_STANDIN_ROOT", os.getcwd())


def get_all_models():
    all_model_classes = []
    for sub_dir in ("extensions", "extensions_built_in"):
        for _, name, _ in pkgutil.iter_modules([os.path.join(TOOLKIT_ROOT, sub_dir)]):
            try:
                module = importlib.import_module(f"{sub_dir}.{name}")
                models = getattr(module, "AI_TOOLKIT_MODELS", None)
                if isinstance(models, list):
                    all_model_classes.extend(models)
            except ImportError as e:
                print(f"Failed to import the {name} module. Error: {str(e)}")
    return all_model_classes


def get_model_class(config):
    for model_class in get_all_models():
        if model_class.arch == config.arch:
            return model_class
    return None  # the real one falls back to StableDiffusion
