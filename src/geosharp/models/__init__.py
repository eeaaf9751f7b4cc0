"""Models shipped with geosharp."""
