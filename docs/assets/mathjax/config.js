// MathJax configuration for the formulas of the site: \( ... \) inline, \[ ... \] and
// $$ ... $$ displayed, as pymdownx.arithmatex (generic mode) and the docstrings' :math:
// roles write them (MathJax's own defaults, spelled out). The whole page is searched, code
// and pre blocks excepted, so a formula that arithmatex did not wrap still renders.
// Loaded before the MathJax script itself (extra_javascript in mkdocs.yml).
//
// MathJax is served with the site, not from a CDN, so formulas render offline:
// tex-chtml-full.js and output/chtml/fonts/woff-v2/ are copied unchanged from the npm
// package mathjax@3.2.2 (es5/), Apache License 2.0 (LICENSE in this folder). The "full"
// build contains every TeX extension, so no extension is fetched at run time.
window.MathJax = {
  tex: {
    inlineMath: [["\\(", "\\)"]],
    displayMath: [["$$", "$$"], ["\\[", "\\]"]],
    processEscapes: true,
  },
};
