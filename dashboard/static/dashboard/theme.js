/* Light or dark: the system's choice (prefers-color-scheme) unless the operator switched it on
   this browser (localStorage "gpuproxy-theme"). Runs in <head>, before the first paint, and
   wires the header's switch once the page is parsed. No dependency. */
(function () {
  "use strict";
  var KEY = "gpuproxy-theme";
  var root = document.documentElement;
  function stored() {
    try { return localStorage.getItem(KEY); } catch (e) { return null; }
  }
  function system() {
    return window.matchMedia && window.matchMedia("(prefers-color-scheme: dark)").matches
      ? "dark" : "light";
  }
  function apply() { root.dataset.theme = stored() || system(); }
  apply();
  if (window.matchMedia) {
    var query = window.matchMedia("(prefers-color-scheme: dark)");
    if (query.addEventListener) query.addEventListener("change", apply);
  }
  document.addEventListener("DOMContentLoaded", function () {
    var button = document.querySelector(".theme-switch");
    if (!button) return;
    function label() { button.textContent = root.dataset.theme === "dark" ? "light" : "dark"; }
    label();
    button.addEventListener("click", function () {
      var next = root.dataset.theme === "dark" ? "light" : "dark";
      try { localStorage.setItem(KEY, next); } catch (e) { /* private mode: this page only */ }
      root.dataset.theme = next;
      label();
    });
  });
})();
