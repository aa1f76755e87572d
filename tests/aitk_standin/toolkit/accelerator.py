def unwrap_model(model):
    return getattr(model, "module", model)
