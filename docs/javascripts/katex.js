// Renders the math pymdownx.arithmatex marks (generic mode: \( \) inline, \[ \] display) with the
// KaTeX the site ships in assets/katex/ (no network), on every page Material loads.
document$.subscribe(({ body }) => {
  renderMathInElement(body, {
    delimiters: [
      { left: "\\[", right: "\\]", display: true },
      { left: "\\(", right: "\\)", display: false },
    ],
    throwOnError: false,
  });
});
