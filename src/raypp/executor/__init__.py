"""Stage workers and the Ray executor that places and drives them."""
