"""The connector's worker side: its load and save pipelines and the media they copy through."""
