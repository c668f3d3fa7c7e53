"""text-generation-inference's API: ``protocol`` (every parameter TGI documents), ``router``."""
