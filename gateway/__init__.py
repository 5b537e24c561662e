"""callgate gateway."""
