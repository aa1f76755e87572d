"""Stand-in `AdvancedPromptEmbeds`: every key holds a LIST with one tensor per batch item."""



class AdvancedPromptEmbeds:
    def __init__(self, **kwargs):
        self._store = {}
        for key, value in kwargs.items():
            self._store[key] = value if isinstance(value, list) else [value]

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        store = self.__dict__.get("_store", {})
        if name in store:
            return store[name]
        raise AttributeError(f"AdvancedPromptEmbeds has no attribute {name!r}")

    def __setattr__(self, name, value):
        if name.startswith("_"):
            super().__setattr__(name, value)
        else:
            self._store[name] = value if isinstance(value, list) else [value]

    def keys(self):
        return list(self._store)

    def __getitem__(self, key):
        return self._store[key]

    def __contains__(self, key):
        return key in self._store

    def to(self, *args, **kwargs):
        out = AdvancedPromptEmbeds()
        out._store = {k: [t.to(*args, **kwargs) for t in v] for k, v in self._store.items()}
        return out

    def detach(self):
        out = AdvancedPromptEmbeds()
        out._store = {k: [t.detach() for t in v] for k, v in self._store.items()}
        return out

    def clone(self):
        out = AdvancedPromptEmbeds()
        out._store = {k: [t.clone() for t in v] for k, v in self._store.items()}
        return out

    def expand_to_batch(self, batch_size):
        out = AdvancedPromptEmbeds()
        for key, value in self._store.items():
            if len(value) == 1:
                out._store[key] = value * batch_size
            elif len(value) == batch_size:
                out._store[key] = value
            else:
                raise ValueError(f"Cannot expand key {key!r} of length {len(value)} to {batch_size}")
        return out

    def save(self, path):
        from safetensors.torch import save_file

        for key, value in self._store.items():
            if len(value) != 1:
                raise ValueError(f"Cannot save key {key!r}: expected list of length 1, got {len(value)}")
        save_file({k: v[0].contiguous() for k, v in self._store.items()}, path)

    @classmethod
    def load(cls, path):
        from safetensors.torch import load_file

        return cls(**load_file(path))

    @classmethod
    def concat_prompt_embeds(cls, prompt_embeds, padding_side="right"):
        store = {}
        for pe in prompt_embeds:
            for key in pe.keys():
                store.setdefault(key, []).extend(pe[key])
        return cls(**store)
