"""A run, ready to share: exported to Hugging Face format or GGUF (llama.cpp, Ollama) with a model
card, and pushed to the Hugging Face Hub.

    source.py  what a run is to an export: its kind, trained context, prompt format, model loaded
    card.py    the model card (README.md): the run folder's own figures, user strings made inert
    export.py  `tinygpt export`: a new folder, written atomically; the folder `push` uploads
    hub.py     `tinygpt push`: the token, the Hub, the upload
"""
