"""KV cache: the page pool tensor, the page allocator and the radix prefix cache."""
