"""Reading weights into modules: pipeline folders, single files, layouts, quantised weights, tokenizers."""
