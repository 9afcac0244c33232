//! kiln-store: the content-addressed store (see DESIGN.md, "Store keys").
