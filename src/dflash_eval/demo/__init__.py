"""The embedded demo: a tokenizer and a tiny hybrid target built offline from stdlib sources.

It lets the whole pipeline run on any machine without a GPU or a model download.
"""
